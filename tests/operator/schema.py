"""Validate an object against the CRD's OpenAPI schema and CEL rules, as the API server would.

kmock does not validate, so the tests do: `jsonschema` checks the structural schema
(the keywords a CRD schema uses mean the same in JSON Schema; `x-kubernetes-*` ones are
ignored by it) and `cel-python` evaluates each `x-kubernetes-validations` rule on the
part of the object it is attached to.
"""

from __future__ import annotations

from typing import Any

import celpy
import celpy.adapter
import celpy.evaluation
import jsonschema

from tests.operator.jobs import crd


def _schema() -> dict[str, Any]:
    version = crd()["spec"]["versions"][0]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def _cel_errors(schema: dict[str, Any], value: Any, path: str, errors: list[str]) -> None:
    """Evaluate the rules attached at `schema` on `value`, then recurse into properties."""
    if not isinstance(value, dict):
        return
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations", []):
        program = env.program(env.compile(rule["rule"]))
        try:
            ok = program.evaluate({"self": celpy.adapter.json_to_cel(value)})
        except celpy.evaluation.CELEvalError as exc:  # a type error the structural schema reports anyway
            errors.append(f"{path}: rule {rule['rule']!r} could not be evaluated ({exc})")
            continue
        if not bool(ok):
            errors.append(f"{path}: {rule.get('message', rule['rule'])}")
    for key, sub in schema.get("properties", {}).items():
        if key in value:
            _cel_errors(sub, value[key], f"{path}.{key}", errors)


def schema_errors(body: dict[str, Any]) -> list[str]:
    """What the API server would say about `body` (empty: accepted)."""
    schema = _schema()
    validator = jsonschema.Draft7Validator(schema)
    errors = [
        f"{'.'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in validator.iter_errors(body)
    ]
    if not errors:
        _cel_errors(schema, body, "", errors)
    return errors
