"""The repo stands alone: no file points at a document a clone does not have, and the README's and
docs/'s relative links (and their #anchors) lead somewhere."""
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
THIS_FILE = Path(__file__).resolve().relative_to(REPO).as_posix()  # it names the patterns it looks for

# Documents that lived outside the repository while it was built: a reference to one resolves only
# when a file of that name is in the checkout (at its root).
OUTSIDE_DOCUMENTS = re.compile(r"\b(DESIGN\.md|RESEARCH\.md)\b|(\.\./shared)\b")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def checkout_files(*suffixes: str) -> list[str]:
    """Tracked and new (not ignored) files of the checkout with one of the suffixes."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\n")
    return sorted(name for name in listed if name.endswith(suffixes) and (REPO / name).is_file())


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchor for each heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def broken_link(source: Path, target: str) -> str | None:
    """Why a relative link from `source` does not resolve, or None when it does."""
    path, _, anchor = target.partition("#")
    resolved = (source.parent / path).resolve() if path else source
    if not resolved.exists():
        return f"{path} does not exist"
    if REPO not in resolved.parents and resolved != REPO:
        return f"{path} is outside the checkout"
    if anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved.read_text()):
        return f"{resolved.relative_to(REPO)} has no heading for #{anchor}"
    return None


def test_no_file_refers_to_a_document_outside_the_checkout():
    problems = []
    for name in checkout_files(".py", ".md", ".yaml"):
        if name == THIS_FILE:
            continue
        for number, line in enumerate((REPO / name).read_text().splitlines(), 1):
            for match in OUTSIDE_DOCUMENTS.finditer(line):
                if match.group(2) or not (REPO / match.group(1)).exists():
                    problems.append(f"{name}:{number}: {match.group(0)} is not in the checkout")
    assert not problems, "\n".join(problems)


def test_relative_links_in_the_docs_resolve():
    pages = checkout_files(".md")
    assert "README.md" in pages and "docs/design.md" in pages
    problems = []
    for name in pages:
        if not (name == "README.md" or name.startswith("docs/")):
            continue
        for number, line in enumerate((REPO / name).read_text().splitlines(), 1):
            for target in MARKDOWN_LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # https:, mailto:
                    continue
                why = broken_link(REPO / name, target)
                if why:
                    problems.append(f"{name}:{number}: ]({target}): {why}")
    assert not problems, "\n".join(problems)


# a config comment citing a section: "(docs/training.md: Objectives and optimisers)" or "(README: Quick start ...)"
CITED_SECTION = re.compile(r"\((docs/[\w./-]+\.md|README)(?::\s*([^)]+))?\)")


def test_config_comments_cite_pages_and_sections_that_exist():
    """A YAML comment that cites a page (and a section of it) names a file of the checkout and a heading
    of that file: three configs once pointed at a README section that did not exist."""
    problems = []
    for name in checkout_files(".yaml", ".json"):
        for number, line in enumerate((REPO / name).read_text().splitlines(), 1):
            for page, section in CITED_SECTION.findall(line.partition("#")[2] if name.endswith(".yaml") else line):
                path = REPO / ("README.md" if page == "README" else page)
                if not path.is_file():
                    problems.append(f"{name}:{number}: {page} does not exist")
                elif section and heading_anchors(f"# {section}").pop() not in heading_anchors(path.read_text()):
                    problems.append(f"{name}:{number}: {page} has no section {section!r}")
    assert not problems, "\n".join(problems)
