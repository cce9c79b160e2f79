"""The documentation holds together: README.md stays a one-page overview (<= 12 KB), every
relative link in the Markdown files resolves (the file, and the #anchor a heading or an
`<a id>` gives), every test the docs name exists, experiment READMEs read as reports, and no
file points outside the repository (a clone has nothing there)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX_BYTES = 12 * 1024

PENDING: set[str] = set()
"""Pages other work adds: a link to one passes while it is absent (its anchors are checked once
it exists). Remove an entry when its page lands."""


def tracked_files() -> list[str]:
    """Repository-relative paths of the tracked files (every file under ROOT outside a VCS or
    cache folder when this is not a git checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode()
        return [p for p in out.split("\0") if p and os.path.isfile(os.path.join(ROOT, p))]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", ".venv-latest", "runs", "__pycache__", ".pytest_cache"}
        found = []
        for d, dirs, files in os.walk(ROOT):
            dirs[:] = [x for x in dirs if x not in skip and not x.endswith(".egg-info")]
            found += [os.path.relpath(os.path.join(d, f), ROOT) for f in files]
        return found


def markdown_files() -> list[str]:
    return sorted(p for p in tracked_files() if p.endswith(".md"))


def doc_pages() -> list[str]:
    """README.md and docs/*.md: the pages whose links and named tests are checked."""
    return ["README.md"] + sorted(p for p in markdown_files() if p.startswith("docs/"))


def read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def without_code(text: str) -> str:
    """Markdown text with fenced code blocks and inline code spans blanked out (a link inside
    code is an example, not a link)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def links(text: str) -> list[str]:
    """Targets of inline Markdown links and images, `[text](target)`."""
    return [m.group(1) for m in re.finditer(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)",
                                            without_code(text))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its rendered text lowercased, punctuation other than
    hyphens and underscores dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The #anchors a Markdown page offers: one per heading (repeats get -1, -2, ... as on
    GitHub) and every explicit `<a id="...">` / `<a name="...">`."""
    found, seen = set(), {}
    body = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", body, flags=re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    found |= set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    return found


def broken_links(page: str) -> list[str]:
    """`page`'s relative links whose file or #anchor does not exist, or that leave the
    repository."""
    bad = []
    for target in links(read(page)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        rel = page if not path else os.path.normpath(
            os.path.join(os.path.dirname(page), path)).replace(os.sep, "/")
        if rel.startswith("../") or os.path.isabs(rel):
            bad.append(f"{target} (outside the repository)")
            continue
        full = os.path.join(ROOT, rel)
        if not os.path.exists(full):
            if rel not in PENDING:
                bad.append(f"{target} (no such file)")
            continue
        if anchor and (not rel.endswith(".md") or anchor not in anchors(read(rel))):
            bad.append(f"{target} (no #{anchor} in {rel})")
    return bad


def test_readme_is_at_most_12_kb():
    size = os.path.getsize(os.path.join(ROOT, "README.md"))
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES})"


@pytest.mark.parametrize("page", doc_pages())
def test_every_relative_link_resolves(page):
    assert not broken_links(page), f"{page}: {broken_links(page)}"


@pytest.mark.parametrize("page", [p for p in markdown_files() if p not in doc_pages()])
def test_every_link_in_the_other_markdown_files_resolves(page):
    """Experiment and bench READMEs, CHANGELOG.md: their links (figures, other reports)."""
    assert not broken_links(page), f"{page}: {broken_links(page)}"


def test_the_link_checker_sees_what_it_should():
    """The checker itself: a missing file, a missing anchor and a link out of the repository
    are found; code spans, URLs and existing anchors are not reported."""
    text = ("# Top `x` level\n## Top x level\n<a id=\"pin\"></a>\n"
            "[a](README.md) [b](#top-x-level-1) [c](#pin) [d](https://x.org/#q) `[e](nope.md)`\n"
            "```\n[f](nope.md)\n```\n[g](nope.md) [h](#nope) [i](../../outside.md)\n")
    assert anchors(text) >= {"top-x-level", "top-x-level-1", "pin"}
    assert links(text) == ["README.md", "#top-x-level-1", "#pin", "https://x.org/#q",
                           "nope.md", "#nope", "../../outside.md"]
    assert slug("5. Replay: `moe/routing/replay.py`'s *ids*") == "5-replay-moeroutingreplaypys-ids"


def named_tests(text: str) -> list[tuple[str, str | None]]:
    """(file, test or None) for every `tests/....py` and `tests/....py::test_x` a page names in
    code spans; `::test_y` right after (same line) belongs to the last file named."""
    out = []
    for line in text.splitlines():
        current = None
        for file, name in re.findall(r"`(tests/[\w/]+\.py)?(?:::(test_\w+))?[^`]*`", line):
            current = file or current
            if current and (file or name):
                out.append((current, name or None))
    return out


@pytest.mark.parametrize("page", doc_pages())
def test_every_test_a_page_names_exists(page):
    """A guarantee or pitfall whose test was renamed or deleted would be unguarded while the
    page still claimed it."""
    missing = []
    for file, name in named_tests(read(page)):
        path = os.path.join(ROOT, file)
        if not os.path.isfile(path):
            missing.append(file)
        elif name and not re.search(rf"^\s*(async\s+)?def {name}\(", read(file), flags=re.M):
            missing.append(f"{file}::{name}")
    assert not missing, f"{page} names tests that do not exist: {missing}"


def test_the_pitfall_page_names_a_test_for_every_pitfall():
    text = read("docs/pitfalls.md")
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(sections) >= 16
    unguarded = [s.splitlines()[0] for s in sections
                 if not any(name for _, name in named_tests(s))]
    assert not unguarded, f"pitfalls without a named test: {unguarded}"


EXPERIMENT_READMES = sorted(p for p in markdown_files()
                            if re.fullmatch(r"experiments/[^/]+/README\.md", p))


@pytest.mark.parametrize("page", EXPERIMENT_READMES)
def test_experiment_readmes_are_reports(page):
    """Question, command, result; no narrative of who changed what when (sessions, issues,
    rounds: that history is CHANGELOG.md's)."""
    text = read(page)
    assert "Question" in text and "Command" in text, page
    diary = re.findall(r"(?<![\w/.])(?:\w+ )?session\b|\bissue \d+|\bthis round\b|\bround one\b",
                       text, flags=re.I)
    assert not diary, f"{page}: {diary}"


def other_texts():
    """(path, text) of each tracked text file but this one (its examples would match)."""
    here = os.path.relpath(os.path.abspath(__file__), ROOT)
    for rel in tracked_files():
        if rel == here or rel.endswith((".png", ".jpg", ".pt", ".whl", ".parquet")):
            continue
        try:
            yield rel, read(rel)
        except UnicodeDecodeError:
            continue


OUTSIDE = re.compile(r"(?<![\w.])(?:\.\./)+[\w.\-/]*|(?<![\w.~])/work/[\w.\-/]*")


def test_no_file_references_a_path_outside_the_repository():
    """A `../x` that climbs out of the repository from the file that names it, or an absolute
    path into this machine's work area: a clone has neither. (This file's own examples
    excepted.)"""
    bad = []
    for rel, text in other_texts():
        for m in OUTSIDE.finditer(text):
            ref = m.group(0)
            if ref.startswith("/work/"):
                bad.append(f"{rel}: {ref}")
                continue
            resolved = os.path.normpath(os.path.join(os.path.dirname(rel), ref))
            if resolved == ".." or resolved.startswith(".." + os.sep):
                bad.append(f"{rel}: {ref}")
    assert not bad, bad


def test_no_file_cites_the_outside_pitfall_list():
    """The pitfall list is docs/pitfalls.md; `PITFALLS #N` / `PITFALLS.md` name a file outside
    the repository."""
    here = os.path.relpath(__file__, ROOT)
    bad = [rel for rel in tracked_files() if rel.endswith((".py", ".md", ".sh", ".yaml"))
           and rel != here and "PITFALLS" in read(rel)]
    assert not bad, bad


INTERNAL = re.compile(r"\bissues? #?\d+|\blease[sd]?\b|\blending\b|\blent\b|\$OUT\b"
                      r"|\bdevice calls?\b", flags=re.I)
"""Words a reader of the repository cannot follow: the numbers of the project's internal issue
list, and the words of how the maintainers borrow GPU machines. A user has a GPU machine, or not."""
MACHINE_PATHS = re.compile(r"(?<![\w.~/])/tmp/[\w.\-/]*")
"""An absolute scratch path a GPU guide would install into: a user's machine need not have it."""


def internal_words(rel: str, text: str) -> list[str]:
    found = [m.group(0) for m in INTERNAL.finditer(text)]
    if rel.startswith(("docs/", "bench/", "experiments/gpu/")):
        found += [m.group(0) for m in MACHINE_PATHS.finditer(text)]
    return found


def test_the_internal_word_check_sees_what_it_should():
    assert internal_words("x.py", "the fix (issue 13) in one lease; a device call under $OUT") \
        == ["issue 13", "lease", "device call", "$OUT"]
    assert internal_words("docs/gpu.md", "install into /tmp/site") == ["/tmp/site"]
    assert internal_words("setup.py", "tmp /tmp/site") == []
    assert internal_words("x.md", "a release, please; silent; PR #79; ROLL #165") == []


def test_no_file_speaks_of_internal_issues_or_borrowed_machines():
    """No internal issue numbers ("issue 13") in code, docs or the changelog, no words of
    borrowed GPU machines (leases, device calls, their output folder), and no scratch paths in
    the GPU guide and bench/: the text speaks to a user with a GPU machine. (This file's own
    examples excepted.)"""
    bad = [f"{rel}: {word}" for rel, text in other_texts() for word in internal_words(rel, text)]
    assert not bad, bad
