"""Writes scaledobject.schema.json: the JSON schema of KEDA's ScaledObject (keda.sh/v1alpha1).

KEDA publishes its CRDs on GitHub only. The PyPI package cloudcoil-models-keda is generated
from them (2.16.1.0 = KEDA 2.16.1's CRDs); this script turns its model into a plain JSON schema
as strict as the API server's field validation: no unknown fields, no nulls. Run it in a
throwaway venv, not the project's:

    python3 -m venv /tmp/keda && /tmp/keda/bin/pip install cloudcoil-models-keda==2.16.1.0
    /tmp/keda/bin/python deploy/kubernetes/schemas/generate_scaledobject.py
"""

import json
from importlib.metadata import version
from pathlib import Path
from typing import Any

from cloudcoil.models.keda.v1alpha1 import ScaledObject

OUT = Path(__file__).with_name("scaledobject.schema.json")
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


def build() -> dict[str, Any]:
    schema = ScaledObject.model_json_schema(by_alias=True, mode="validation")
    del schema["properties"]["status"]
    schema = tighten(reachable(schema))
    schema["properties"]["apiVersion"] = {"const": "keda.sh/v1alpha1"}
    schema["properties"]["kind"] = {"const": "ScaledObject"}
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    source = f"cloudcoil-models-keda {version('cloudcoil-models-keda')} (KEDA's CRD)"
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$comment": source, **schema}


if __name__ == "__main__":
    OUT.write_text(json.dumps(build(), indent=1, sort_keys=True) + "\n")
