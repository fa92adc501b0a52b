"""The temporary directories workers own (pdserve/tempdirs.py): where an engine's goes,
what its processes are told, which orphans a sweep removes."""

import os
import subprocess
import sys
import tempfile

from pdserve import tempdirs


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def test_only_the_directories_of_dead_owners_are_swept(tmp_path):
    dead = _dead_pid()
    for name in (f"pdserve-metrics-w1-{dead}-abc", f"pdserve-engine-{dead}-k2j4x_9q",  # dead: swept
                 f"pdserve-metrics-w2-{os.getpid()}-abc", f"pdserve-engine-{os.getpid()}-abc",  # alive: kept
                 "pdserve-metrics-old-abc", "pdserve-engine-abc",  # no pid in the name: not ours to judge
                 f"pdserve-other-{dead}-abc"):  # not a kind we own
        (tmp_path / name).mkdir()
    (tmp_path / f"pdserve-engine-{dead}-file").write_text("")  # a file, not our directory
    assert sorted(tempdirs.sweep_orphans([str(tmp_path)])) == [f"pdserve-engine-{dead}-k2j4x_9q",
                                                               f"pdserve-metrics-w1-{dead}-abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([
        "pdserve-engine-abc", f"pdserve-engine-{dead}-file", f"pdserve-engine-{os.getpid()}-abc",
        "pdserve-metrics-old-abc", f"pdserve-metrics-w2-{os.getpid()}-abc", f"pdserve-other-{dead}-abc"])


def test_an_engine_directory_stays_in_the_temp_directory_while_socket_paths_fit():
    prefix = "pdserve-engine-4194304-"  # the longest pid Linux gives
    # 107 bytes: the parent, "/", the prefix (23), 8 random characters, "/" and a uuid4 (36).
    fits = "/" + "t" * (107 - 1 - 23 - 8 - 37 - 1)
    assert tempdirs.engine_dir_parent(fits, prefix) == fits
    assert tempdirs.engine_dir_parent(fits + "t", prefix) == "/tmp"


def test_an_engine_directory_is_made_removed_and_given_to_the_engine(monkeypatch):
    short = tempfile.mkdtemp(prefix="pdt", dir="/tmp")  # pytest's tmp_path is too long for sockets
    try:
        monkeypatch.setattr(tempfile, "tempdir", short)
        d = tempdirs.engine_dir()
        assert os.path.dirname(d.name) == short
        assert os.path.basename(d.name).startswith(f"pdserve-engine-{os.getpid()}-")
        assert tempdirs.engine_env(d.name) == {"TMPDIR": d.name, "VLLM_RPC_BASE_PATH": d.name}
        d.cleanup()
        assert os.listdir(short) == []
    finally:
        os.rmdir(short)


def test_an_engine_directory_goes_to_tmp_when_the_temp_directory_is_too_long(tmp_path, monkeypatch):
    long = tmp_path / ("t" * 60)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    d = tempdirs.engine_dir()
    try:
        assert os.path.dirname(d.name) == "/tmp"
    finally:
        d.cleanup()


def test_a_script_s_engine_directory_holds_what_it_writes_and_goes_with_it(monkeypatch):
    short = tempfile.mkdtemp(prefix="pdt", dir="/tmp")
    try:
        monkeypatch.setattr(tempfile, "tempdir", short)
        monkeypatch.setenv("TMPDIR", short)
        monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
        with tempdirs.engine_dir_of_this_process() as path:
            assert os.path.dirname(path) == short
            assert os.environ["TMPDIR"] == os.environ["VLLM_RPC_BASE_PATH"] == path
            assert tempfile.gettempdir() == path
            open(os.path.join(path, "socket-like"), "w").close()  # what vLLM leaves behind
        assert os.listdir(short) == []
        assert os.environ["TMPDIR"] == short and "VLLM_RPC_BASE_PATH" not in os.environ
        assert tempfile.gettempdir() == short
    finally:
        os.rmdir(short)
