import random
import socket

import pytest

from pdserve import ports


def range_file(tmp_path, low: int, high: int) -> str:
    path = tmp_path / "ip_local_port_range"
    path.write_text(f"{low}\t{high}\n")
    return str(path)


def test_free_port_is_bindable_and_below_the_ephemeral_range(tmp_path):
    path = range_file(tmp_path, 32768, 60999)
    picked = [ports.free_port(rng=random.Random(seed), range_file=path) for seed in range(20)]
    assert all(ports.LOWEST <= p < 32768 for p in picked)
    assert len(set(picked)) == len(picked)  # one process never gets a port twice
    with socket.socket() as s:
        s.bind(("127.0.0.1", picked[-1]))


class Picks:
    """An rng whose picks are given."""

    def __init__(self, *picks: int):
        self.picks = iter(picks)

    def randrange(self, low: int, high: int) -> int:
        return next(self.picks)


def test_a_port_in_use_or_handed_out_is_never_picked(tmp_path):
    path = range_file(tmp_path, 32768, 60999)
    given = ports.free_port(range_file=path)
    with socket.socket() as held, socket.socket() as probe:
        held.bind(("127.0.0.1", 0))
        held.listen()
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
        probe.close()
        busy = held.getsockname()[1]
        assert ports.free_port(rng=Picks(busy, given, free), range_file=path) == free


def test_no_room_below_the_range_falls_back_to_the_kernels_pick(tmp_path):
    path = range_file(tmp_path, ports.LOWEST + 10, 60999)
    port = ports.free_port(range_file=path)
    assert port >= ports.LOWEST + 10  # from the kernel's (real) ephemeral range


@pytest.mark.parametrize("text", ["", "garbage"])
def test_an_unreadable_range_reads_as_linux_default(tmp_path, text):
    path = tmp_path / "range"
    path.write_text(text)
    assert ports.ephemeral_low(str(path)) == 32768
    assert ports.ephemeral_low(str(tmp_path / "missing")) == 32768


def test_free_port_block_is_free_and_consecutive():
    base = ports.free_port_block(3)
    for port in range(base, base + 3):
        assert ports.bindable("127.0.0.1", port)
