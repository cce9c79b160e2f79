"""experiments/throughput/README.md's tables each have a writer, and each writer its table: every
`<!-- table:NAME -->` marker pair is filled by a bench/ command the README names (`--marker
NAME`, or a tool whose default marker is NAME), and every usage line in bench/ that writes into
this README names markers that are there (`tools.result_table.write_into` refuses a file
without them)."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = "experiments/throughput/README.md"


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def _markers(text: str) -> list[str]:
    begins = re.findall(r"<!-- table:([\w-]+):begin -->", text)
    ends = re.findall(r"<!-- table:([\w-]+):end -->", text)
    assert begins == ends, (begins, ends)
    return begins


def _default_markers() -> dict[str, str]:
    """bench module -> the marker its `add_readme_args(parser, NAME)` defaults to."""
    out = {}
    for name in sorted(os.listdir(os.path.join(ROOT, "bench"))):
        if name.endswith(".py"):
            m = re.search(r"add_readme_args\(\w+, \"([\w-]+)\"\)", _read(f"bench/{name}"))
            if m:
                out[f"bench.{name[:-3]}"] = m.group(1)
    out["bench.throughput --sweep"] = out.pop("bench.sweep")  # the sweep runs through throughput
    return out


def test_every_table_has_a_writer_named_in_the_readme():
    text = _read(README)
    explicit = set(re.findall(r"--marker ([\w-]+)", text))
    by_default = {marker for tool, marker in _default_markers().items()
                  if re.search(rf"python -m {re.escape(tool)}\b(?:(?!python -m)[^`])*?"
                               rf"--readme {README}", text)}
    orphans = [m for m in _markers(text) if m not in explicit | by_default]
    assert not orphans, f"tables no command in {README} writes: {orphans}"


def test_every_bench_usage_line_into_the_readme_finds_its_markers():
    markers, defaults = set(_markers(_read(README))), _default_markers()
    for name in sorted(os.listdir(os.path.join(ROOT, "bench"))):
        if not name.endswith(".py"):
            continue
        doc = ast.get_docstring(ast.parse(_read(f"bench/{name}"))) or ""
        for line in doc.splitlines():
            if f"--readme {README}" not in line:
                continue
            m = re.search(r"--marker ([\w-]+)", line)
            tool = "bench.throughput --sweep" if "--sweep" in line else f"bench.{name[:-3]}"
            marker = m.group(1) if m else defaults[tool]
            assert marker in markers, f"bench/{name}: `{line.strip()}` writes table:{marker}"
