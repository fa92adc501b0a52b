"""Per-class SLO attainment of `--save-records` compare JSONs against one set of
objectives given here, so that runs calibrated separately (an A/B of two commits, each
`--systems pdserve`) are read against the same bar.

    python scripts/class_attainment.py CLASS=TTFT_S:TPOT_S[,CLASS=...] FILE [FILE ...]

A request meets its class's objectives when it was served (not refused, no error), its first
token came within TTFT_S of its send and its mean time per output token after the first was
within TPOT_S. Per system and rate: each class's met / sent, with its late on TTFT, late on
TPOT and refused."""

import json
import sys


def parse_slos(text: str) -> dict[str, tuple[float, float]]:
    slos = {}
    for part in text.split(","):
        name, _, pair = part.partition("=")
        ttft, _, tpot = pair.partition(":")
        slos[name] = (float(ttft), float(tpot))
    return slos


def verdict(r: dict, ttft_s: float, tpot_s: float) -> str:
    """'met', 'refused', 'error', 'ttft', 'tpot' or 'ttft+tpot'."""
    if r.get("error"):
        return "refused" if r["error"] == "RESOURCE_EXHAUSTED" else "error"
    chunks = r.get("chunks") or []
    if not chunks:
        return "error"
    ttft = chunks[0]["time_s"] - r["send_s"]
    n = r.get("output_tokens") or 0
    tpot = (r["done_s"] - chunks[0]["time_s"]) / (n - 1) if n > 1 else 0.0
    late = [k for k, bad in (("ttft", ttft > ttft_s), ("tpot", tpot > tpot_s)) if bad]
    return "+".join(late) or "met"


def main() -> None:
    slos = parse_slos(sys.argv[1])
    for path in sys.argv[2:]:
        d = json.load(open(path))
        for system, runs in d["detail"].items():
            if system == "unloaded":
                continue
            for run in runs:
                parts, met_all, sent_all = [], 0, 0
                for name, (ttft_s, tpot_s) in slos.items():
                    got = [verdict(r, ttft_s, tpot_s) for r in run["records"] if r["class_name"] == name]
                    met = got.count("met")
                    met_all, sent_all = met_all + met, sent_all + len(got)
                    parts.append(f"{name} {met}/{len(got)} (TTFT late {sum('ttft' in g for g in got)}, TPOT late "
                                 f"{sum('tpot' in g for g in got)}, refused {got.count('refused')})")
                print(f"{path} {system} {run['rate_rps']} req/s: all {met_all}/{sent_all} "
                      f"({100 * met_all / max(sent_all, 1):.1f}%); " + "; ".join(parts))


if __name__ == "__main__":
    main()
