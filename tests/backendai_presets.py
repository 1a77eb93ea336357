"""Backend.AI's query presets as its manager renders them (manager/clients/prometheus/preset.py):
``PromQLTemplateRenderer.render`` and ``regex_union``, for the tests that run the shipped presets
against a real Prometheus."""

from __future__ import annotations

import re


def render_preset(template: str, labels: dict[str, tuple[str, str]], group_by: set[str], window: str) -> str:
    """``PromQLTemplateRenderer.render``: labels as ``key op "value"`` pairs, escaped as it escapes them."""
    import jinja2
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(variable_start_string="${{", variable_end_string="}}",
                                                       undefined=jinja2.StrictUndefined)

    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")

    label_str = ",".join(f'{key}{op}"{escape(value)}"' for key, (op, value) in labels.items())
    return env.from_string(template).render(labels=label_str, window=window, group_by=",".join(sorted(group_by)))


def regex_union(values: list[str]) -> str:
    """``preset.regex_union``: the values as one regex alternation."""
    return "|".join(re.escape(v).replace(r"\-", "-") for v in values)
