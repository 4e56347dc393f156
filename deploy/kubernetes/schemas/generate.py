"""Writes the JSON schemas of the custom kinds in deploy/kubernetes/: KEDA's ScaledObject
(keda.sh/v1alpha1) and the Prometheus Operator's PodMonitor and PrometheusRule
(monitoring.coreos.com/v1).

Both projects publish their CRDs on GitHub only. The PyPI packages cloudcoil-models-keda
(2.16.1.0: KEDA 2.16.1's CRDs) and cloudcoil-models-prometheus-operator (0.80.1.0) are
generated from them; this script turns their models into plain JSON schemas as strict as the
API server's field validation: no unknown fields, no nulls. Run it in a throwaway venv, not
the project's:

    python3 -m venv /tmp/crds && /tmp/crds/bin/pip install cloudcoil-models-keda==2.16.1.0 \
        cloudcoil-models-prometheus-operator==0.80.1.0
    /tmp/crds/bin/python deploy/kubernetes/schemas/generate.py
"""

import json
from importlib.metadata import version
from pathlib import Path
from typing import Any

from cloudcoil.models.keda.v1alpha1 import ScaledObject
from cloudcoil.models.prometheus_operator.v1 import PodMonitor, PrometheusRule

HERE = Path(__file__).parent
KINDS = {
    ScaledObject: ("keda.sh/v1alpha1", "cloudcoil-models-keda"),
    PodMonitor: ("monitoring.coreos.com/v1", "cloudcoil-models-prometheus-operator"),
    PrometheusRule: ("monitoring.coreos.com/v1", "cloudcoil-models-prometheus-operator"),
}
DROP = {"title", "default", "description"}


def tighten(node: Any) -> Any:
    """Optional fields become plain ones (a null is pruned, not allowed) and every object
    with declared properties refuses unknown ones (kubectl's strict field validation)."""
    if isinstance(node, list):
        return [tighten(item) for item in node]
    if not isinstance(node, dict):
        return node
    options = node.get("anyOf", [])
    if len(options) == 2 and {"type": "null"} in options:
        node = {**node, **next(o for o in options if o != {"type": "null"})}
        del node["anyOf"]
    node = {key: tighten(value) for key, value in node.items() if key not in DROP}
    if "(?i)" in node.get("pattern", ""):  # Go allows the flag anywhere, Python only first
        node["pattern"] = "(?i)" + node["pattern"].replace("(?i)", "")
    if node.get("properties") and "additionalProperties" not in node:
        node["additionalProperties"] = False
    return node


def reachable(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with only the $defs its properties refer to."""
    defs, keep = schema["$defs"], set()
    while True:
        text = json.dumps([schema["properties"], *(defs[name] for name in keep)])
        found = {name for name in defs if f'"#/$defs/{name}"' in text}
        if found <= keep:
            return {**schema, "$defs": {name: defs[name] for name in sorted(keep)}}
        keep |= found


def build(model: Any, api_version: str, package: str) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True, mode="validation")
    schema["properties"].pop("status", None)
    schema = tighten(reachable(schema))
    schema["properties"]["apiVersion"] = {"const": api_version}
    schema["properties"]["kind"] = {"const": model.__name__}
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    source = f"generated from {package} {version(package)} by generate.py"
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$comment": source, **schema}


if __name__ == "__main__":
    for model, (api_version, package) in KINDS.items():
        out = HERE / f"{model.__name__.lower()}.schema.json"
        out.write_text(json.dumps(build(model, api_version, package), indent=1, sort_keys=True) + "\n")
