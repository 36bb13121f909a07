"""The README's promises: its title, then the two set-up commands, and its
embedding example runs as printed."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_starts_with_its_title_then_the_two_commands():
    lines = README.read_text().splitlines()
    assert lines[0] == "# step engine"
    first = [line.strip() for line in lines[1:5] if line.strip()]
    assert first[0].startswith("make demo") and first[1].startswith("make test")


def _python_block(containing: str) -> str:
    return next(block for block in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if containing in block)


def test_embedding_example_runs():
    block = _python_block("StepEngine(")
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    out = namespace["out"]
    assert len(out.tokens) == 2 and all(len(t) == 1 for t in out.tokens)
    assert out.seeds[1] == 1234


def test_llm_example_runs_on_the_tiny_model(capsys):
    """The LLM example as printed, on the seeded random model (SmolLM2 would take minutes)."""
    block = _python_block("LLM(")
    assert 'LLM("smollm2")' in block and "max_tokens=48" in block
    cheap = block.replace('LLM("smollm2")', 'LLM("tiny", max_num_reqs=2)').replace("max_tokens=48", "max_tokens=8")
    exec(compile(cheap, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "'Hello' -> " in out and "'Name three colors.' -> " in out


ROOT = README.parent
DOCS = ROOT / "docs"


def test_readme_links_resolve_and_the_contract_lives_in_the_repo():
    text = README.read_text()
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert {"docs/contract.md", "docs/api.md", "docs/coming-from-vllm.md", "docs/architecture.md"} <= set(links)
    for link in links:
        assert (ROOT / link).is_file(), link
    for doc in [README, *DOCS.glob("*.md")]:
        body = doc.read_text()
        assert "../" "shared" not in body and "SPEC" " §" not in body, doc.name
        for link in re.findall(r"\]\(([^)#:]+)\)", body):  # relative links between docs
            assert (doc.parent / link).exists(), f"{doc.name}: {link}"


def test_no_tracked_file_points_outside_the_repo():
    """A clone holds nothing outside itself: code and docs cite docs/contract.md sections."""
    import subprocess

    try:
        files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]
    outside = "../" + "shared"  # spelled apart so this file does not match itself
    spec_section = "SPEC" + " §"
    offenders = [name for name in files if name.endswith((".py", ".md", ".sh", ".toml", ".json", "Makefile"))
                 and (outside in (ROOT / name).read_text(errors="ignore") or spec_section in (ROOT / name).read_text(errors="ignore"))]
    assert not offenders, offenders


def test_contract_keeps_the_section_numbers_code_comments_cite():
    headings = re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", (DOCS / "contract.md").read_text(), re.M)
    assert headings == ["1", "1.1", "1.2", "1.3", "1.4", "1.5", "2", "2.1", "2.2", "3", "4", "5", "5.1", "6"]


def test_api_reference_names_every_public_name():
    import engine.ops
    import graphs
    import engine

    api = (DOCS / "api.md").read_text()
    public_ops = [n for n, v in vars(engine.ops).items()
                  if callable(v) and not n.startswith("_") and getattr(v, "__module__", "") == "engine.ops"]
    readme_imports = re.findall(r"from engine[\w.]* import ([\w, ]+)", README.read_text())
    names = {*engine.__all__, *graphs.__all__, *public_ops,
             *(n.strip() for group in readme_imports for n in group.split(","))}
    missing = sorted(n for n in names if f"`{n}" not in api)
    assert not missing, missing
