"""What a newcomer reads: compile progress without a terminal (the plan table, diff and YAML errors are
tested beside their commands: test_recipe.py, test_build.py)."""

from neffbuild.cli.compile_cmd import LineProgress, make_progress


def _lines(capsys):
    return [line.split("s  ", 1)[1] for line in capsys.readouterr().err.splitlines()]


def test_progress_lines_without_a_terminal(capsys):
    """Each event is a line at once; a target still running after 2 s is announced, and every 30 s a line
    says what still runs (a live bar would show nothing in a pipe until the first target finished)."""
    now = [0.0]
    p = LineProgress(clock=lambda: now[0], tick_s=3600)  # ticks driven by hand below
    p.stage("loading weights")
    p.start(3)
    for label in ("a", "b", "c"):
        p.running(label)
    p.finished({"label": "c", "status": "ok", "hit": True})
    assert _lines(capsys) == ["loading weights", "3 targets (largest first)", "c: cache hit"]
    now[0] = 1.0
    p.beat()
    assert _lines(capsys) == []  # a hit finishes at once: no "started" line for it, none yet for a, b
    now[0] = 2.5
    p.beat()
    assert _lines(capsys) == ["a: started", "b: started"]
    now[0] = 31.0
    p.beat()
    assert _lines(capsys) == ["still running: a (31s), b (31s)"]
    now[0] = 40.0
    p.finished({"label": "a", "status": "ok", "hit": False, "compile_seconds": 30.2})
    p.finished({"label": "b", "status": "failed", "kind": "timeout", "error": "gave up after 30s"})
    p.close()
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("compile [2/3]    40s") and err[0].endswith("a: compiled in 40s (compiler 30.2s)")
    assert err[1].endswith("[3/3]    40s  b: FAILED (timeout): gave up after 30s")


def test_no_terminal_means_progress_lines():
    assert isinstance(make_progress(), LineProgress)  # pytest's stderr is not a terminal



def test_an_output_path_on_a_pseudo_file_system_is_refused_before_any_work(tmp_path):
    """bench --plot /proc/x.png failed after the whole run: /proc passes access() for root yet refuses a file."""
    from neffbuild.fsutil import output_problem
    from tests.helpers import cli

    assert "cannot be created there" in output_problem("/proc/x.png", "--plot")
    assert output_problem(tmp_path / "x.png", "--plot") is None and not (tmp_path / "x.png").exists()
    res = cli("bench", str(tmp_path), "--plot", "/proc/x.png")
    assert res.returncode == 2 and "--plot /proc/x.png" in res.stderr and "Traceback" not in res.stderr
