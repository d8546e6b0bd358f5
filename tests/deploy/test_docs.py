"""The README and docs/ agree with the CLI: every flag is documented, every link resolves, and
the README's quick start only uses what the CLI accepts and waits for the stack it starts."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import unicodedata
from pathlib import Path

import pytest

from services.cli import COMMANDS, build_parser
from tests.deploy.utils import REPO

README = REPO / "README.md"
DOCS_DIR = REPO / "docs"
CONFIGURATION = DOCS_DIR / "configuration.md"
PAGES = [README, *sorted(DOCS_DIR.glob("*.md"))]
# the services and the launcher: their flags belong in configuration.md
SERVICE_COMMANDS = ("up", "worker", "scheduler", "router")
EXPECTED_PAGES = {
    "api.md",
    "configuration.md",
    "deployment.md",
    "development.md",
    "observability.md",
    "performance.md",
    "scale-out.md",
    "security.md",
    "simulation.md",
    "speculative-decoding.md",
    "tensor-parallel.md",
    "training.md",
}


def long_options(parser: argparse.ArgumentParser) -> set[str]:
    """Every `--flag` of a parser and of its sub-commands, without --help."""
    found = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= long_options(sub)
        else:
            found |= {o for o in action.option_strings if o.startswith("--") and o != "--help"}
    return found


def command_options(name: str) -> set[str]:
    parser = argparse.ArgumentParser(prog=f"conveyor {name}")
    importlib.import_module(COMMANDS[name][0]).add_arguments(parser)
    return long_options(parser)


def is_documented(flag: str, text: str) -> bool:
    """`--port` must appear as itself (not inside `--scheduler-port`); a boolean pair
    `--x` / `--no-x` may be written `--[no-]x`."""
    spellings = [flag, "--[no-]" + flag.removeprefix("--").removeprefix("no-")]
    return any(re.search(rf"(?<![\w-]){re.escape(s)}(?![\w-])", text) for s in spellings)


def test_docs_has_one_page_per_audience():
    assert {p.name for p in DOCS_DIR.glob("*.md")} == EXPECTED_PAGES


def test_readme_shows_the_make_targets():
    text = README.read_text()
    for target in ("make demo", "make test", "make lint"):
        assert target in text, target


@pytest.mark.parametrize("name", SERVICE_COMMANDS)
def test_every_service_flag_is_in_configuration(name):
    text = CONFIGURATION.read_text()
    missing = sorted(f for f in command_options(name) if not is_documented(f, text))
    assert not missing, f"`conveyor {name}` flags missing from {CONFIGURATION.name}: {missing}"


def test_global_flags_are_in_configuration():
    text = CONFIGURATION.read_text()
    parser_flags = {o for a in build_parser()._actions for o in a.option_strings}
    for flag in sorted(parser_flags - {"-h", "--help"}):
        assert is_documented(flag, text), flag


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_flag_of_every_subcommand_is_in_docs(name):
    text = "\n".join(p.read_text() for p in PAGES)
    missing = sorted(f for f in command_options(name) if not is_documented(f, text))
    assert not missing, f"`conveyor {name}` flags missing from README.md and docs/: {missing}"


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces to dashes."""
    text = unicodedata.normalize("NFC", heading.strip().lower())
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {github_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_between_pages_resolve(page):
    targets = links(page)
    for target in targets:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: link to missing {target}"
        if anchor:
            assert anchor in anchors(dest), f"{page.name}: no heading #{anchor} in {dest.name}"


def test_readme_links_every_docs_page():
    linked = {Path(t.partition("#")[0]).name for t in links(README) if t.startswith("docs/")}
    assert linked == EXPECTED_PAGES


def quick_start() -> str:
    text = README.read_text()
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    first = re.search(r"```bash\n(.*?)```", section, re.S)
    assert first, "no bash block in the README's quick start"
    return first.group(1)


def shell_commands(block: str) -> list[list[str]]:
    """The simple commands of a shell block: words split at pipes, lists, redirections,
    `$(`...`)` and comments."""
    commands = []
    for line in block.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for token in lexer:
            if token and set(token) <= set("();<>|&$"):
                commands.append(words)
                words = []
            else:
                words.append(token)
        commands.append(words)
    return [c for c in commands if c]


def conveyor_commands() -> list[list[str]]:
    return [c[1:] for c in shell_commands(quick_start()) if c[0] == "conveyor"]


def test_quick_start_uses_only_what_the_cli_accepts():
    parser = build_parser()
    used = set()
    for argv in conveyor_commands():
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(
                f"the quick start runs `conveyor {shlex.join(argv)}`, which the CLI rejects"
            )
        used.add(argv[0])
    assert {"models", "up", "health", "generate", "stats"} <= used


def test_quick_start_waits_for_the_stack_it_starts_and_stops_it():
    parser = build_parser()
    parsed = {argv[0]: parser.parse_args(argv) for argv in conveyor_commands()}
    block = quick_start()
    assert re.search(r"^conveyor up .*&$", block, re.M), "conveyor up is not in the background"
    assert parsed["health"].wait > 0, "the quick start does not wait for SERVING"
    assert parsed["health"].address.rsplit(":", 1)[1] == str(parsed["up"].port)
    assert parsed["generate"].server.rsplit(":", 1)[1] == str(parsed["up"].port)
    assert parsed["stats"].server.rsplit(":", 1)[1] == str(parsed["up"].scheduler_port)
    assert re.search(r"^kill \$UP_PID", block, re.M) and "UP_PID=$!" in block
    lines = block.splitlines()
    order = [
        next(i for i, line in enumerate(lines) if word in line)
        for word in ("conveyor up", "conveyor health", "conveyor generate", "kill")
    ]
    assert order == sorted(order)
