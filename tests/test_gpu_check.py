"""scripts/gpu_check.py on CPU: the plan of the GPU window (every part's command built and
checked, the total within 8 minutes), and the runner itself on the parts a CPU can run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))

import gpu_check  # noqa: E402
import gpu_check_report  # noqa: E402


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_dry_run_plans_the_default_parts_within_eight_minutes(tmp_path):
    proc = _run(str(tmp_path), "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = json.loads((tmp_path / "gpu_check_plan.json").read_text())
    default = [p.name for p in gpu_check.PARTS if p.default]
    assert [p["part"] for p in plan["parts"]] == default
    assert {"gpu_tests", "train_mfu", "train_mfu_unfused", "kernels", "checkpoint",
            "dpo"} <= set(default)  # issue 41's GPU claims are in every default run
    assert all(p["checked"] for p in plan["parts"]), plan
    assert all(p["est_s"] > 0 and p["command"] for p in plan["parts"])
    assert plan["total_est_s"] <= plan["budget_s"] <= gpu_check.MAX_WALL_S == 480
    for part in default:  # the printed plan names each part with its estimate
        assert part in proc.stdout
    # every part's command parses: the optional ones (--only) too, the default ones above (not
    # again: their check collects the GPU tests in a pytest process, ~3 s)
    optional = ",".join(p.name for p in gpu_check.PARTS if not p.default)
    assert len(optional.split(",")) >= 2  # --only takes a list
    proc = _run(str(tmp_path / "all"), "--dry-run", "--only", optional, "--budget", "480")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = json.loads((tmp_path / "all" / "gpu_check_plan.json").read_text())
    assert [p["part"] for p in plan["parts"]] == optional.split(",")
    assert all(p["checked"] for p in plan["parts"]), plan


def test_runner_records_parts_and_skips_what_does_not_fit(tmp_path):
    """Real runs of two parts on CPU: versions (figures) and the gpu tests (collected and
    skipped with their reason here); then a budget too small for the tests: skipped, said so."""
    proc = _run(str(tmp_path / "a"), "--only", "versions,gpu_tests", "--budget", "300")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "a" / "gpu_check.json").read_text())
    versions, tests = report["parts"]["versions"], report["parts"]["gpu_tests"]
    assert versions["status"] == "ok" and versions["figures"]["packages"]["megatron-core"]
    assert tests["status"] == "ok" and tests["figures"]["tests"] >= 3
    assert all(c["outcome"].startswith("skipped: ") for c in tests["figures"]["cases"].values())
    md = (tmp_path / "a" / "gpu_check.md").read_text()
    assert "**versions**" in md and "**gpu_tests**" in md

    proc = _run(str(tmp_path / "b"), "--only", "gpu_tests", "--budget", "20")  # versions: above
    report = json.loads((tmp_path / "b" / "gpu_check.json").read_text())
    skipped = report["parts"]["gpu_tests"]
    assert skipped["status"] == "skipped" and "would not fit" in skipped["error"], skipped
    assert proc.returncode == 1  # not every part ran

    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nbefore\n")
    for _ in range(2):  # recording a run twice replaces its entry, keeps the rest
        assert _run("--record", str(tmp_path / "a" / "gpu_check.json"),
                    "--docs", str(docs)).returncode == 0
    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\nbefore\n")
    assert text.count(gpu_check_report.BEGIN) == 1 and text.count("### GPU check,") == 1
    later = json.loads((tmp_path / "b" / "gpu_check.json").read_text())
    later["date"] = "2099-01-01 00:00 UTC"  # another run: kept beside the first, newest first
    (tmp_path / "b" / "gpu_check.json").write_text(json.dumps(later))
    assert _run("--record", str(tmp_path / "b" / "gpu_check.json"), "--docs",
                str(docs)).returncode == 0
    text = docs.read_text()
    assert text.count("### GPU check,") == 2 and text.count(gpu_check_report.BEGIN) == 1
    assert text.index("2099-01-01") < text.index("### GPU check,", text.index("2099-01-01") + 1)


def test_pytest_results_keep_the_failure_text(tmp_path):
    """A failing test's traceback end is kept (what to fix after a GPU window), not its title."""
    case = tmp_path / "test_fails.py"
    case.write_text("def test_boom():\n    x = {'deep': 1}\n    assert x['deep'] == 2, 'why: x'\n")
    xml = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={xml}", str(case)], cwd=tmp_path, capture_output=True)
    got = gpu_check._pytest_read(xml)
    assert got["failures"] == 1
    (only,) = got["cases"].values()
    assert only["outcome"].startswith("failure: ") and "why: x" in only["detail"]
