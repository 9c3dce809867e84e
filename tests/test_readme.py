"""The README stays a newcomer's page: at most 200 lines, its methods table equal to the method
registry's render, every relative link (README and docs/guide.md) pointing at a file that
exists, and its two commands found by the parsing CI uses (`.ci/run`'s awk program, run as is)."""

import pathlib
import re
import shutil
import subprocess

import pytest

from spec_jax.decoding import methods
from spec_jax.programs import methods as methods_program

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 200


def test_readme_is_short():
  lines = README.read_text(encoding="utf-8").splitlines()
  assert len(lines) <= MAX_LINES, (
      f"README.md has {len(lines)} lines (at most {MAX_LINES}): move detail to docs/guide.md and "
      "dated numbers to experiments/<name>/notes.md.")


def test_methods_table_matches_the_registry():
  section = methods_program.readme_section(README.read_text(encoding="utf-8"))
  assert section == methods_program.readme_table(), (
      "README.md's methods table differs from the method registry (a method was registered, "
      f"renamed or changed). Regenerate it: `{methods_program.REGENERATE}`.")


def test_a_new_method_makes_the_table_stale_until_regenerated(tmp_path):
  """The check above can fail: a registered method changes the render, and `--readme`'s
  rewrite (on a copy of the README) brings the table back in line, leaving the rest as it was."""
  copy = tmp_path / "README.md"
  shutil.copy(README, copy)
  method = methods.Method("readme_probe", "a probe method for the README test",
                          build=lambda source, shape, options: None,
                          shape=lambda ints, depth, options, width: None, kinds=("lm",))
  methods.register(method)
  try:
    stale = methods_program.readme_section(copy.read_text(encoding="utf-8"))
    assert stale != methods_program.readme_table()
    assert methods_program.update_readme(copy) is True
    fresh = copy.read_text(encoding="utf-8")
    assert methods_program.readme_section(fresh) == methods_program.readme_table()
    assert "| `readme_probe` | `readme_probe@γ` | exact | LM or feature drafter |" in fresh
    assert methods_program.update_readme(copy) is False  # already up to date
  finally:
    methods.unregister("readme_probe")
  original = README.read_text(encoding="utf-8")
  table_start = original.index(methods_program.README_BEGIN)
  assert fresh[:table_start] == original[:table_start]  # only the table moved
  assert fresh.split(methods_program.README_END)[1] == original.split(methods_program.README_END)[1]


def test_missing_markers_name_the_fix():
  with pytest.raises(ValueError, match=re.escape(methods_program.REGENERATE)):
    methods_program.readme_section("# a README without a methods table\n")


def _anchors(path: pathlib.Path) -> set[str]:
  """`<a id="...">` anchors and GitHub heading slugs of a markdown file."""
  text = path.read_text(encoding="utf-8")
  ids = set(re.findall(r'<a id="([^"]+)"', text))
  for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    ids.add(slug)
  return ids


@pytest.mark.parametrize("doc", ["README.md", "docs/guide.md"])
def test_relative_links_point_to_existing_files(doc):
  source = ROOT / doc
  links = re.findall(r"\]\(([^)\s]+)\)", source.read_text(encoding="utf-8"))
  relative = [l for l in links if not re.match(r"[a-z]+:", l)]
  assert relative, f"{doc} should link to the other documents"
  broken = []
  for link in relative:
    target, _, anchor = link.partition("#")
    path = (source.parent / target).resolve() if target else source
    if not path.exists():
      broken.append(f"{link} (no file {target})")
    elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
      broken.append(f"{link} (no anchor #{anchor} in {path.name})")
  assert not broken, f"{doc} has broken relative links: {broken}"


def _ci_awk_program() -> str:
  """The awk program `.ci/run` runs on README.md to find the test command."""
  script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
  found = re.search(r"awk '([^']+)' README\.md", script)
  assert found, ".ci/run no longer reads the command with awk: update this test with it."
  return found.group(1)


@pytest.mark.skipif(shutil.which("awk") is None, reason="needs awk, as .ci/run does")
@pytest.mark.parametrize("marker, expected", [
    ("test-command", ".venv/bin/python -m pytest -q -n 2 tests"),
    ("main-command", ".venv/bin/python launch.py --config configs/quickstart.py "
                     "--workdir runs/quickstart"),
])
def test_the_two_commands_are_found_as_ci_finds_them(marker, expected):
  program = _ci_awk_program()
  assert "<!-- test-command -->" in program
  program = program.replace("<!-- test-command -->", f"<!-- {marker} -->")
  out = subprocess.run(["awk", program, str(README)], capture_output=True, text=True, check=True)
  command = out.stdout.strip()
  assert command.startswith("python3.11 -m venv .venv && "), command
  assert command.endswith(expected), command
  # The line CI runs is the README's code line itself, once.
  assert README.read_text(encoding="utf-8").count(command + "\n") == 1
