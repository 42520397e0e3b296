"""Hostile CLI input: arguments, the compile cache, output paths that are not ours, exit codes and one JSON
document under --json.

Each case ends in a clean error (or correct output), never a crash."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from neffbuild.cli.generate_cmd import _parse_prompt
from neffbuild.errors import InvalidInput
from tests.conftest import ROOT, TINY
from tests.helpers import run_cli, strict_json

# -- arguments

@pytest.mark.parametrize("text", ["1 2 3", "1,,2", "", " ", "1,x", "-1", "1.0", "1,٢", "0x10", "1;2", "9" * 11])
def test_prompt_ids_accept_only_comma_separated_ascii_integers(text):
    with pytest.raises(InvalidInput, match="comma-separated token ids"):
        _parse_prompt(text)


def test_prompt_ids_parse():
    assert _parse_prompt("1,2, 3 ,40") == [1, 2, 3, 40]


def test_compile_out_under_a_file_is_a_clean_usage_error(tmp_path):
    (tmp_path / "afile").write_text("x")
    code, out, err, unhandled = run_cli("compile", str(TINY), "-o", str(tmp_path / "afile" / "out"), "--json")
    assert unhandled is None and code == 2 and "--out" in strict_json(out)["error"]["message"], err


def test_unknown_option_with_json_is_one_json_error():
    code, out, _, _ = run_cli("validate", str(TINY), "--json", "--bogus")
    assert code == 2 and strict_json(out)["error"]["kind"] == "NoSuchOption"

# -- the compile cache

def test_cache_ls_reads_without_side_effects(tmp_path):
    from neffbuild.compiler.cache import CACHE_VERSION

    entries = tmp_path / f"v{CACHE_VERSION}" / "entries"
    for name, meta in (("deep", "[" * 100_000 + "]" * 100_000), ("typo", '{"file": 3, "bytes": "x"}'),
                       ("junk", "\xff")):
        (entries / name).mkdir(parents=True)
        (entries / name / "meta.json").write_text(meta)
    code, out, err, unhandled = run_cli("cache", "ls", "--json", "--cache-dir", str(tmp_path))
    assert unhandled is None and code == 0 and strict_json(out) == [], err
    assert sorted(p.name for p in entries.iterdir()) == ["deep", "junk", "typo"]  # nothing deleted

# -- write only what you own ----------------------------------------------------------------------------

def _special_outputs(tmp_path, bundle):

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "target").write_text("keep me")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    (tmp_path / "folder").mkdir()
    return {"dev-null": ("/dev/null", "a device"), "fifo": (str(tmp_path / "fifo"), "a FIFO"),
            "symlink": (str(tmp_path / "link"), "a symbolic link"),
            "missing-parent": (str(tmp_path / "no" / "such" / "h.csv"), "does not exist"),
            "into-a-bundle": (str(Path(bundle) / "weights" / "h.csv"), "inside the bundle"),
            "+ folder": (str(tmp_path / "folder"), "is a directory"),  # click refuses it first, exit 2
            "+ bundle-root": (str(Path(bundle) / "h.csv"), "inside the bundle")}


OUTPUT_CASES = ["dev-null", "fifo", "symlink", "missing-parent", "into-a-bundle", "+ folder", "+ bundle-root"]


@pytest.mark.parametrize("case", OUTPUT_CASES)
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_output_paths_that_are_not_ours_are_refused_before_any_work(built, tmp_path, command, case):

    bundle = built.bundle
    path, needle = _special_outputs(tmp_path, bundle)[case]
    before = sorted(os.listdir(bundle)), sorted(os.listdir(Path(bundle) / "weights"))
    args = (["generate", str(bundle), "--prompt-ids", "1,2", "--histogram", path] if command == "generate"
            else ["bench", str(bundle), "--plot", path])
    code, out, err, unhandled = run_cli(*args, "--json")
    assert unhandled is None and code == 2 and needle in strict_json(out)["error"]["message"], (out, err)
    assert (sorted(os.listdir(bundle)), sorted(os.listdir(Path(bundle) / "weights"))) == before
    assert Path("/dev/null").is_char_device() and (tmp_path / "target").read_text() == "keep me"
    assert (tmp_path / "link").is_symlink() and Path(tmp_path / "fifo").is_fifo()


def test_output_file_is_written_in_place_or_created(tmp_path):

    from neffbuild.fsutil import write_output

    p = tmp_path / "h.csv"
    p.write_text("old, longer than the new text")
    inode = os.stat(p).st_ino
    write_output(p, "new", "--histogram")
    assert p.read_text() == "new" and os.stat(p).st_ino == inode  # in place: same file, no rename over it
    write_output(tmp_path / "fresh.csv", b"x", "--histogram")
    assert (tmp_path / "fresh.csv").read_bytes() == b"x"


def test_cache_clear_of_home_removes_nothing(tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("secret")
    (home / "notes.txt").write_text("mine")
    res = subprocess.run([sys.executable, "-m", "neffbuild.cli.main", "cache", "clear", "--yes"], capture_output=True,
                         text=True, cwd=ROOT, check=False,
                         env=dict(__import__("os").environ, HOME=str(home), NEFFBUILD_CACHE_DIR=str(home)))
    assert res.returncode == 0 and "removed 0 entries" in res.stdout, res.stderr
    assert (home / ".ssh" / "id_ed25519").read_text() == "secret" and (home / "notes.txt").read_text() == "mine"


def test_cache_clear_removes_only_its_own_tree_and_counts_truly(tmp_path):
    from neffbuild.compiler.cache import CACHE_VERSION, Cache

    c = Cache(tmp_path).ensure()
    for key in ("a" * 64, "b" * 64, "c" * 64):  # entries as publish writes them (clear deletes nothing else)
        (c.entries_dir / key).mkdir()
        (c.entries_dir / key / "meta.json").write_text("{}")
    (tmp_path / "mine.txt").write_text("keep")
    code, out, err, _ = run_cli("cache", "clear", "--yes", "--cache-dir", str(tmp_path))
    assert code == 0 and "removed 3 entries" in out, err
    assert not (tmp_path / f"v{CACHE_VERSION}").exists() and (tmp_path / "mine.txt").read_text() == "keep"
    # + a folder named like the cache's tree that holds someone else's files: refused, nothing removed
    own = tmp_path / f"v{CACHE_VERSION}"
    (own / "entries").mkdir(parents=True)
    (own / "thesis.tex").write_text("years of work")
    code, out, err, _ = run_cli("cache", "clear", "--yes", "--cache-dir", str(tmp_path))
    assert code == 2 and "nothing removed" in err and (own / "thesis.tex").exists()

# -- CLI: exit codes, JSON on errors, non-regular inputs, stdout kept for the JSON ----------------------

def test_recommend_refuses_non_regular_histograms(tmp_path):

    os.mkfifo(tmp_path / "fifo")
    for path, needle in ((str(tmp_path / "fifo"), "not a regular file"), ("/dev/zero", "not a regular file"),
                         (str(tmp_path), "is a directory")):  # + a folder (click refuses it)
        code, out, err, unhandled = run_cli("recommend", "--histogram", path, "--max-model-len", "512", "--json")
        assert unhandled is None and code == 2 and needle in out, (path, out, err)


def test_bench_refuses_bad_input_before_timing(built, eagle3_built):
    code, out, _, unhandled = run_cli("bench", str(built.bundle), "--context", "100000", "--json")
    assert unhandled is None and code == 2 and "above the bundle's max_model_len (512)" in out
    code, out, _, unhandled = run_cli("bench", str(eagle3_built.bundle), "--json")
    assert unhandled is None and code == 2 and "EAGLE3" in strict_json(out)["error"]["message"]


@pytest.mark.parametrize("args,env,needle", [
    (["compile", str(TINY), "-o", "/tmp/never", "--cache-dir", "/dev/null/cache"], {}, "--cache-dir /dev/null/cache"),
    (["compile", str(TINY), "-o", "/tmp/never", "--cache-dir", "/proc/neffbuild-cache"], {}, "cannot write there"),
    (["validate", str(TINY)], {"NEFFBUILD_LOG": "garbage"}, "NEFFBUILD_LOG='garbage'"),
    (["cache", "ls"], {"NEFFBUILD_LOG": "1e9"}, "NEFFBUILD_LOG"),
], ids=["cache-dir-under-a-file", "+ cache-dir-on-proc", "log-garbage", "+ log-on-another-command"])
def test_environment_and_folders_are_exit_2_with_json(args, env, needle):
    res = subprocess.run([sys.executable, "-m", "neffbuild.cli.main", *args, "--json"], capture_output=True,
                         text=True, cwd=ROOT, check=False, timeout=120, env=dict(__import__("os").environ, **env))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert needle in strict_json(res.stdout)["error"]["message"]


def test_native_output_stays_off_stdout_under_json():
    """What UCX does under `generate --di --json`: a native library writes to file descriptor 1."""
    code = ("import os, sys\nfrom neffbuild.cli.output import keep_native_output_off_stdout\n"
            "keep_native_output_off_stdout()\nos.write(1, b'[UCX WARN] native noise\\n')\n"
            "os.system('echo child noise')\nprint('{\"ok\": true}')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert strict_json(res.stdout) == {"ok": True}
    assert "[UCX WARN] native noise" in res.stderr and "child noise" in res.stderr
