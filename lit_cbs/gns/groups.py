"""Which parameters the noise scale measures together (``GradientNoiseScale(groups=...)``); no Lightning."""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import Any

import torch

from lit_cbs.errors import LitCBSConfigError
from lit_cbs.models.decoder import layer_stacks

GROUP_PRESETS = ("param_groups", "blocks")


def _some_names(names: list[str]) -> str:
    return ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")


def block_groups(names: list[str], stacks: list[str]) -> dict[str, list[str]]:
    """``groups="blocks"``: ``block<i>`` per block of a stack (a later stack's prefixed), else a group per module."""
    if not stacks:
        raise LitCBSConfigError(
            "groups='blocks' looks for the model's stack of transformer blocks (an nn.ModuleList of modules of one "
            "class, as lit_cbs's OLMo.blocks or a transformers model's model.layers), but the LightningModule has "
            f"none; parameters: {_some_names(names)}; pass groups={{name: regex}} instead"
        )
    parent = stacks[0].rpartition(".")[0]
    prefix = parent + "." if parent else ""
    parts = [name.split(".")[:-1] for name in names]
    shared = "".join(level[0] + "." for level in itertools.takewhile(lambda level: len(set(level)) == 1, zip(*parts)))
    patterns = [(stack, re.compile(rf"^{re.escape(stack)}\.(\d+)\.")) for stack in stacks]
    groups: dict[str, list[str]] = {}
    for name in names:
        if match := next(((stack, found) for stack, pattern in patterns if (found := pattern.match(name))), None):
            stack, found = match
            group = f"block{found.group(1)}"
            if stack != stacks[0]:
                group = f"{stack.removeprefix(prefix).rpartition('.')[0] or stack}.{group}"
        else:
            relative = name.removeprefix(prefix) if name.startswith(prefix) else name.removeprefix(shared)
            group = relative.rpartition(".")[0] or relative  # the module's path; a parameter of the root: its own name
        groups.setdefault(group, []).append(name)
    return groups


def compiled_groups(groups: Any) -> dict[str, re.Pattern[str]] | None:
    """The ``groups`` argument checked: {group: compiled regex} for a dict, None for None or a preset."""
    if groups is None or (isinstance(groups, str) and groups in GROUP_PRESETS):
        return None
    if not isinstance(groups, Mapping) or not groups:
        raise LitCBSConfigError(
            f"groups={groups!r} is not supported; use None, one of {GROUP_PRESETS} or a non-empty dict of "
            "group name -> regex over parameter names"
        )
    compiled = {}
    for group, pattern in groups.items():
        if not isinstance(group, str) or not group:
            raise LitCBSConfigError(f"groups has the name {group!r}; group names must be non-empty strings")
        if not isinstance(pattern, str):
            raise LitCBSConfigError(f"groups[{group!r}]={pattern!r} must be a regex string over parameter names")
        try:
            compiled[group] = re.compile(pattern)
        except re.error as error:
            raise LitCBSConfigError(f"groups[{group!r}]={pattern!r} is not a valid regex: {error}") from error
    return compiled


def assign_groups(
    groups: str | Mapping[str, str] | None, optimizer: torch.optim.Optimizer, module: torch.nn.Module
) -> tuple[list[str | None], dict[torch.Tensor, int]]:
    """The groups' names and each trained parameter's group index; the group None holds those in no group."""
    trained = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if groups == "param_groups":
        names = [group.get("name", f"pg{i}") for i, group in enumerate(optimizer.param_groups)]
        if repeated := sorted({name for name in names if names.count(name) > 1}):
            raise LitCBSConfigError(
                f"groups='param_groups' names each group by its optimizer parameter group's 'name', but {repeated} "
                "name more than one group: give the parameter groups distinct names"
            )
        group_of: dict[torch.Tensor, int] = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        return names, {p: i for p, i in group_of.items() if p.requires_grad}
    if groups is None:
        return [None], dict.fromkeys(trained, 0)
    trained_ids = {id(p) for p in trained}
    by_name = {name: p for name, p in module.named_parameters() if id(p) in trained_ids}
    names = list(by_name)
    if groups == "blocks":
        members = block_groups(names, layer_stacks(module))
    else:  # {group: regex}: each finds a name (re.search), no name is in two
        patterns = compiled_groups(groups) or {}
        members = {group: [name for name in names if pattern.search(name)] for group, pattern in patterns.items()}
        for name in names:
            if len(owners := [group for group, found in members.items() if name in found]) > 1:
                raise LitCBSConfigError(
                    f"parameter {name!r} is matched by groups {owners} ("
                    + ", ".join(f"{group}={patterns[group].pattern!r}" for group in owners)
                    + "); a parameter may be in one group only: "
                    "make the regexes disjoint (e.g. anchor them with '^' or '\\.')"
                )
        if empty := [group for group, found in members.items() if not found]:
            raise LitCBSConfigError(
                f"groups[{empty[0]!r}]={patterns[empty[0]].pattern!r} matches none of the trained parameters "
                f"({_some_names(names)}); fix the regex (matched with re.search) or remove the group"
            )
    group_names: list[str | None] = list(members)
    group_of = {by_name[name]: i for i, group in enumerate(members.values()) for name in group}
    if len(group_of) < len(trained):  # parameters in no group keep the whole-model sums complete
        group_names.append(None)
        group_of.update({p: len(members) for p in trained if p not in group_of})
    return group_names, group_of
