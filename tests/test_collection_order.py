"""Any combination of test files on one command line runs with its folders' conftest fixtures
(tests/conftest.py's ``pytest_configure`` orders the files by path under pytest 9.1, pytest#14964)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_files_of_a_folder_named_around_a_file_of_the_folder_above_keep_their_conftest_fixtures():
    # toolkit's files use tests/toolkit/conftest.py's sd_pipe; a file of tests/ between them made
    # pytest 9.1 forget it for the second: "fixture 'sd_pipe' not found", 7 errors
    files = ["tests/toolkit/test_analyze_model.py", "tests/test_any_number.py", "tests/toolkit/test_inspect_model.py"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "--setup-plan", "-q", *files],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "not found" not in done.stdout and done.returncode == 0, done.stdout[-3000:]
    assert done.stdout.count("SETUP    S sd_pipe") == 1, done.stdout[-3000:]
