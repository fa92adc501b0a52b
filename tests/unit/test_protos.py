"""The committed stubs are what `make protos` generates from the committed .proto files."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_protos(tmp_path):
    (tmp_path / "protos").mkdir()
    for proto in (ROOT / "protos").glob("*.proto"):
        shutil.copy(proto, tmp_path / "protos" / proto.name)
    protos = sorted(f"protos/{p.name}" for p in (tmp_path / "protos").glob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.",
         "--grpc_python_out=.", *protos],
        cwd=tmp_path,
        check=True,
    )
    generated = sorted(p.name for p in (tmp_path / "protos").iterdir() if p.suffix in (".py", ".pyi"))
    assert generated, "protoc generated nothing"
    for name in generated:
        committed = (ROOT / "protos" / name).read_text()
        assert committed == (tmp_path / "protos" / name).read_text(), f"protos/{name} is stale: run `make protos`"
