"""The config files under configs/ and the generated key reference of the docs site.

- A group file (configs/<group>/<choice>.yaml, extending `/schema/<group>`) sets only what differs
  from the schema's default: a leaf equal to its default restates the schema and goes stale when
  the default moves (issue 44). `name` is exempt: it names the choice. Files in the global package
  (`# @package _global_`: model presets, experiments) override other groups' values, where a default
  may be the point, and are not checked.
- docs/config_reference.md is `orchestrator/config/reference.py`'s `render()`: regenerate it with
  `python -m orchestrator.config.reference > docs/config_reference.md`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from orchestrator.config.reference import all_keys, render
from orchestrator.config.run import GROUP_SCHEMAS

REPO = Path(__file__).resolve().parent.parent
GROUP_FILES = [(g, p) for g in GROUP_SCHEMAS for p in sorted((REPO / "configs" / g).glob("*.yaml"))
               if not p.read_text().startswith("# @package _global_")]


def leaves_equal_to_default(group: str, path: Path) -> list[str]:
    """Dotted keys of `path` whose value is the schema's default (`name` aside)."""
    defaults = OmegaConf.to_container(OmegaConf.structured(GROUP_SCHEMAS[group]), resolve=False)
    found = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    found.pop("defaults", None)
    out: list[str] = []

    def walk(node: dict, dflt: dict, prefix: str) -> None:
        for k, v in node.items():
            if prefix == group and k == "name":
                continue
            if isinstance(v, dict) and isinstance(dflt.get(k), dict) and v:
                walk(v, dflt[k], f"{prefix}.{k}")
            elif k in dflt and dflt[k] == v:
                out.append(f"{prefix}.{k}")

    walk(found, defaults, group)
    return out


@pytest.mark.parametrize("group,path", GROUP_FILES, ids=[f"{g}/{p.name}" for g, p in GROUP_FILES])
def test_a_group_file_sets_only_what_differs_from_the_schema(group, path):
    same = leaves_equal_to_default(group, path)
    assert not same, (f"{path.relative_to(REPO)} restates the schema's default of {same}: remove those lines "
                      "(docs/config_reference.md lists every default)")


def test_the_check_finds_a_restated_default(tmp_path):
    """The check above can fail: a file restating `trainer.lr`'s default is flagged."""
    restated = tmp_path / "fsdp.yaml"
    lr = next(k.default for k in all_keys() if k.key == "trainer.lr")
    restated.write_text(f"name: fsdp\nlr: {lr}\ntotal_steps: 3\n")
    assert leaves_equal_to_default("trainer", restated) == ["trainer.lr"]


def test_the_config_reference_page_is_current():
    page = REPO / "docs" / "config_reference.md"
    assert page.is_file() and page.read_text() == render(), (
        "docs/config_reference.md is stale: python -m orchestrator.config.reference > docs/config_reference.md")


def test_the_reference_lists_every_key_once_with_its_default():
    keys = [k.key for k in all_keys()]
    assert len(keys) == len(set(keys))
    assert {"trainer.lr", "rollout.acr.limits.requests_per_s", "async.max_staleness"} <= set(keys)
    assert next(k for k in all_keys() if k.key == "rollout.n").default == str(
        OmegaConf.structured(GROUP_SCHEMAS["rollout"]).n)
