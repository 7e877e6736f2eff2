"""bench/run.py on its tiny CPU set: the table is written, each row measured, the ratio to the seeds' recipe filled.
A benchmark is never a timed test: no threshold on any figure."""
import re
import subprocess
import sys

from conftest import ROOT


def test_tiny_benchmark_writes_the_table_and_the_ratio(tmp_path):
    run = subprocess.run([sys.executable, "bench/run.py", "--set", "tiny", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    table = (tmp_path / "BENCHMARKS.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| demo |")]
    assert len(rows) == 2 and "seeds' recipe" in rows[0] and "ZeRO-2, 2 ranks" in rows[1]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert all(len(c) == 16 for c in cells)
    assert cells[0][-1] == "1.0x" and re.fullmatch(r"\d+\.\dx", cells[1][-1])  # the ratio, measured in this run
    assert all(float(c[8].replace(",", "")) > 0 for c in cells)  # useful tokens/s
    assert cells[1][6] == "yes" and cells[0][6] == "no"  # packing
    assert (tmp_path / "throughput.png").stat().st_size > 1000
