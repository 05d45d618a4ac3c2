"""The README's benchmark tables are generated from the benchmarks' own JSON, never typed by hand."""

from benchmarks import report


def test_readme_tables_match_benchmark_json():
    assert report.main(["--check"]) == 0, "run `python -m benchmarks.report` after a benchmark"
