"""The readings written by hand in docs/ quote numbers that their generated sources hold.

docs/mup/README.md and the other evidence pages are generated and checked for staleness
(test_mup, test_optimizers, test_variants); the paragraphs that read them (docs/mup.md,
docs/optimizers.md, docs/variants.md) are prose, and would keep an old number when the evidence
is remade. Each such reading sits between `<!-- numbers from: SOURCE, ... -->` and
`<!-- end numbers -->` (paths relative to docs/); every decimal it quotes must be one of its
sources' numbers at the reading's rounding (the sign aside: "better by 0.049" quotes a
difference of -0.049), and every "mean ± spread" both numbers of one pair there."""
import json
import re
from itertools import combinations

import pytest

from conftest import ROOT

DOCS = ROOT / "docs"
BLOCK = re.compile(r"<!-- numbers from: (.*?) -->(.*?)<!-- end numbers -->", re.S)
# a decimal, not part of a name (Pythia-6.9B, 0.8M); a pair's may be whole numbers ("73 ± 6 steps")
NUMBER = r"[-+−]?\d+\.\d+(?:e[-+]?\d+)?(?![A-Za-z\d])"
WHOLE_OR_DECIMAL = r"[-+−]?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![A-Za-z\d.])"
PAIR = re.compile(rf"(?<![\w.])({WHOLE_OR_DECIMAL})\s+±\s+({WHOLE_OR_DECIMAL})")
LONE = re.compile(rf"(?<![\w.])({NUMBER})")


def magnitude(text: str) -> float:
    return abs(float(text.replace("−", "-")))


def half_unit(text: str) -> float:
    """Half a unit in the last written digit: 1.31 -> 0.005, 2.1e-3 -> 0.5e-4."""
    mantissa, _, exponent = text.lstrip("+-−").partition("e")
    return 0.5 * 10.0 ** (int(exponent or 0) - len(mantissa.partition(".")[2]))


def rounds_to(quoted: str, value: float) -> bool:
    return abs(magnitude(quoted) - abs(value)) <= half_unit(quoted) * (1 + 1e-9)


def drifts(evidence: dict) -> list[tuple[float, float]]:
    """The optimum's drift between every two sizes of every LR sweep (the README gives the
    smallest to the largest only), as mean and 95% half-width: plots' own statistic."""
    from tools import plots
    doc = plots.upgrade(evidence)
    out = []
    for part, settings in doc["settings"].items():
        if not part.startswith("lr_"):
            continue
        stats = plots.sweep_stats(doc, part)
        for a, b in combinations(sorted(stats), 2):
            out.append(plots.difference(stats[a]["place"], stats[b]["place"]))
    return out


def source_numbers(name: str) -> tuple[list[float], list[tuple[float, float]]]:
    """A source's numbers and its "a ± b" pairs. A README is read as text; an evidence.json
    gives the drifts between any two sizes."""
    path = DOCS / name
    assert path.is_file(), f"a reading names {name}, which docs/ lacks"
    if path.name == "evidence.json":
        pairs = drifts(json.loads(path.read_text()))
        return [v for pair in pairs for v in pair], pairs
    text = path.read_text()
    return ([magnitude(n) for n in LONE.findall(text)],
            [(magnitude(a), magnitude(b)) for a, b in PAIR.findall(text)])


def readings() -> list[tuple[str, list[str], str]]:
    found = []
    for page in sorted(DOCS.glob("*.md")):
        for sources, text in BLOCK.findall(page.read_text()):
            text = re.sub(r"\]\([^)]*\)", "]", text)  # a link's target is no quote
            found.append((page.name, [s.strip() for s in sources.split(",")], text))
    return found


READINGS = readings()


def unbacked(text: str, sources: list[str]) -> list[str]:
    """The quotes in text that none of the sources holds."""
    singles, pairs = [], []
    for name in sources:
        s, p = source_numbers(name)
        singles += s
        pairs += p
    missing = []
    for a, b in PAIR.findall(text):
        if not any(rounds_to(a, x) and rounds_to(b, y) for x, y in pairs):
            missing.append(f"{a} ± {b}")
    for n in LONE.findall(PAIR.sub(" ", text)):
        if not any(rounds_to(n, x) for x in singles):
            missing.append(n)
    return missing


def test_every_page_that_reads_evidence_marks_its_readings():
    """The pages whose prose quotes generated evidence, each with at least one marked reading (a
    reading whose markers were lost would go unchecked)."""
    pages = {page for page, _, _ in READINGS}
    assert {"mup.md", "optimizers.md", "variants.md"} <= pages, pages


@pytest.mark.parametrize("page,sources,text", READINGS,
                         ids=[f"{page}:{sources[0]}" for page, sources, _ in READINGS])
def test_a_reading_quotes_only_what_its_sources_hold(page, sources, text):
    missing = unbacked(text, sources)
    assert not missing, (f"docs/{page}: the reading of {', '.join(sources)} quotes {missing}, "
                         "which the sources do not hold: remake the reading from them")


def test_the_check_refuses_a_number_the_source_lacks():
    """The checker itself, on one line of docs/mup/README.md: its pair, rounded, passes; a spread
    changed in its last digit, a mean from another row and a lone number absent fail."""
    line = "drift -2.08 ± 0.36 grid steps"
    assert unbacked(line, ["mup/README.md"]) == []
    assert unbacked("drift -2.1 ± 0.4", ["mup/README.md"]) == []
    assert unbacked("drift -2.08 ± 0.37", ["mup/README.md"]) == ["-2.08 ± 0.37"]
    assert unbacked("drift -1.92 ± 0.36", ["mup/README.md"]) == ["-1.92 ± 0.36"]
    assert unbacked("a slope of 9.876", ["mup/README.md"]) == ["9.876"]
