"""bench/run.py on its tiny CPU set: the table is written, each row measured, the ratio to the seeds' recipe filled.
A benchmark is never a timed test: no threshold on any figure."""
import re
import subprocess
import sys

from conftest import ROOT, load_script

sys.path.insert(0, str(ROOT))
import plan  # noqa: E402


def test_tiny_benchmark_writes_the_table_and_the_ratio(tmp_path):
    run = subprocess.run([sys.executable, "bench/run.py", "--set", "tiny", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    table = (tmp_path / "BENCHMARKS.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| demo |")]
    assert len(rows) == 2 and "seeds' recipe" in rows[0] and "ZeRO-2, 2 ranks" in rows[1]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert all(len(c) == 17 for c in cells)
    assert cells[0][-1] == "1.0x" and re.fullmatch(r"\d+\.\dx", cells[1][-1])  # the ratio, measured in this run
    assert all(float(c[8].replace(",", "")) > 0 for c in cells)  # useful tokens/s
    assert cells[1][6] == "yes" and cells[0][6] == "no"  # packing
    assert (tmp_path / "throughput.png").stat().st_size > 1000


def test_a_probe_that_fails_is_a_row_and_the_set_goes_on(tmp_path, monkeypatch):
    bench = load_script("bench/run.py")
    monkeypatch.setitem(bench.SETS, "probe", {"demo": (2, 128, [
        bench.run("too big", batch=100000, probe=True),  # fails: less data than one global batch
        bench.run("fits", batch=4, probe=True)])})
    rows = bench.main(["--set", "probe", "--out", str(tmp_path)])
    assert [row["run"].split(":")[0] for row in rows] == ["too big", "fits"]  # no peer for a set of probes
    assert "did not run (error: " in rows[0]["run"] and "less than one global batch" in rows[0]["run"]
    assert rows[1]["result"]["tokens_per_sec"] > 0
    table = (tmp_path / "BENCHMARKS.md").read_text()
    assert "| demo | too big: did not run (error: " in table and "| demo | fits | 1 |" in table


def test_planned_memory_is_the_planners_figure_for_the_run():
    bench = load_script("bench/run.py")
    config = plan.load_config("facebook/opt-1.3b")
    psi, largest = plan.count_params(config)
    spec = bench.run("x", stage=3, offload="cpu", precision="bf16", batch=4)
    acts = plan.activations(4, 512, 2048, 24, config.vocab_size, checkpointing=False)
    states = plan.model_states(psi, largest, 1, 1)["ZeRO-3 + CPU offload"][0]
    assert bench.planned_bytes(spec, config, 512) == states + acts
    single = bench.run("y", precision="bf16", batch=4)  # one GPU without DeepSpeed: the ZeRO-0 arithmetic, 16 bytes
    assert bench.planned_bytes(single, config, 512) == 16 * psi + acts
    assert bench.planned_bytes(bench.run("z"), config, 512) is None  # fp32: not the planner's case
