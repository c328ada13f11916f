"""What an API server does to a custom resource before it stores it: defaults, then the schema and CEL rules.

The lab's API emulator (kmock) stores whatever it is sent, so on its own it would let
through every ElasticJob that a real cluster refuses at `kubectl apply`. `Admission`
plays that part from the CRD object itself, the way kube-apiserver does:

1. pruning: a field the schema does not declare (where it does not keep unknown fields)
   is dropped, or with `fieldValidation=Strict` (what kubectl sends) the object is refused
   naming it (`pruned`);
2. defaults: every `default` of the schema is filled in where the field is absent
   (recursively, so a defaulted object gets its own fields' defaults), and the stored
   object carries them;
3. the structural schema (types, required fields, minimums, enums, patterns), checked
   with `jsonschema` (the keywords a CRD schema uses mean the same in JSON Schema);
4. every `x-kubernetes-validations` rule, evaluated with `cel-python` on the part of the
   object it is attached to, `fieldPath` and `message` included. A rule that names
   `oldSelf` is a transition rule: it runs on an update only, where the old object has
   a value at that place too, as the API server's are.

Only standard CEL is used by our rules (no Kubernetes string extensions), so the same
rule text runs here and in the API server. The `lab` extra carries the two libraries;
they are imported when the first object is checked.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from typing import Any

RULE_OLD_SELF = "oldSelf"
OBJECT_FIELDS = frozenset({"apiVersion", "kind", "metadata"})
"""The root fields the API server handles itself, whatever the schema says (ObjectMeta is never pruned)."""

logging.getLogger("celpy").setLevel(logging.WARNING)  # several debug lines per rule evaluated, otherwise


def pruned(schema: Mapping[str, Any], value: Any, unknown: list[str], path: str = "") -> Any:
    """`value` without the fields `schema` does not declare below a node that does not keep unknown fields
    (`x-kubernetes-preserve-unknown-fields`), as the API server prunes them (a copy); the path of each
    one dropped is appended to `unknown` (`.spec.template.spec.nodeSelecter`): what it refuses instead
    under `fieldValidation=Strict`."""
    if isinstance(value, dict):
        declared = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        kept: dict[str, Any] = {}
        for key, item in value.items():
            sub = declared.get(key, extra if isinstance(extra, Mapping) else None)
            if not path and key in OBJECT_FIELDS:
                kept[key] = copy.deepcopy(item)
            elif sub is not None:
                kept[key] = pruned(sub, item, unknown, f"{path}.{key}")
            elif schema.get("x-kubernetes-preserve-unknown-fields"):
                kept[key] = copy.deepcopy(item)
            else:
                unknown.append(f"{path}.{key}")
        return kept
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [pruned(schema["items"], item, unknown, f"{path}[{index}]") for index, item in enumerate(value)]
    return copy.deepcopy(value)


def _checkable(schema: Any) -> Any:
    """The schema as jsonschema reads it: `x-kubernetes-int-or-string` is `integer` or `string` (pure)."""
    if isinstance(schema, list):
        return [_checkable(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {key: _checkable(sub) for key, sub in schema.items()}
    if schema.get("x-kubernetes-int-or-string") and "type" not in schema:
        out["type"] = ["integer", "string"]
    return out


class AdmissionError(ValueError):
    """An object the API server would refuse; `problems` in the API server's order (schema, then rules)."""

    status = 422

    def __init__(self, kind: str, name: str, problems: Sequence[str]) -> None:
        super().__init__(f'{kind} "{name}" is invalid: ' + "; ".join(problems))
        self.problems = list(problems)


class UnknownFieldsError(AdmissionError):
    """Fields the schema does not declare, under `fieldValidation=Strict`: the API server answers 400
    (its decoder refuses the body before any validation)."""

    status = 400

    def __init__(self, kind: str, name: str, problems: Sequence[str]) -> None:
        ValueError.__init__(self, f'{kind} "{name}" cannot be handled: strict decoding error: ' + ", ".join(problems))
        self.problems = list(problems)


def apply_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """`value` with the schema's defaults filled in where a field is absent (a copy; pure)."""
    if isinstance(value, dict):
        result = dict(value)
        for key, sub in (schema.get("properties") or {}).items():
            if key not in result and "default" in sub:
                result[key] = copy.deepcopy(sub["default"])
            if key in result:
                result[key] = apply_defaults(sub, result[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            declared = set(schema.get("properties") or {})
            result.update({k: apply_defaults(extra, v) for k, v in result.items() if k not in declared})
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [apply_defaults(schema["items"], item) for item in value]
    return copy.deepcopy(value)


class Admission:
    """Admits objects of one CRD (its served storage version) as the API server would.

    :param crd: the CustomResourceDefinition object, as applied to a cluster.
    """

    def __init__(self, crd: Mapping[str, Any]) -> None:
        spec = crd["spec"]
        self.group: str = spec["group"]
        self.plural: str = spec["names"]["plural"]
        self.kind: str = spec["names"]["kind"]
        self.schemas: dict[str, Mapping[str, Any]] = {
            f"{self.group}/{version['name']}": version["schema"]["openAPIV3Schema"]
            for version in spec["versions"]
            if version.get("served", True)
        }
        self._checked: dict[int, tuple[Mapping[str, Any], Any]] = {}
        """jsonschema's reading of each schema checked, by identity (the schema kept, so its id stays its)."""
        self._programs: dict[str, Any] = {}

    def admit(
        self, new: Mapping[str, Any], old: Mapping[str, Any] | None = None, *, strict: bool = False
    ) -> dict[str, Any]:
        """The object as it would be stored (unknown fields pruned, defaults filled in); raises
        `AdmissionError` listing every problem.

        :param old: the stored object, on an update (transition rules compare against it).
        :param strict: refuse unknown fields instead of pruning them (`fieldValidation=Strict`).
        """
        name = str((new.get("metadata") or {}).get("name", ""))
        schema = self.schemas.get(str(new.get("apiVersion", "")))
        if schema is None:
            versions = ", ".join(sorted(self.schemas))
            raise AdmissionError(self.kind, name, [f"apiVersion: {new.get('apiVersion')!r} is not served ({versions})"])
        unknown: list[str] = []
        kept = pruned(schema, new, unknown)
        if unknown and strict:
            raise UnknownFieldsError(self.kind, name, [f'unknown field "{where.lstrip(".")}"' for where in unknown])
        stored: dict[str, Any] = apply_defaults(schema, kept)
        problems = self.problems(schema, stored, None if old is None else apply_defaults(schema, old))
        if problems:
            raise AdmissionError(f"{self.kind}.{self.group}", name, problems)
        return stored

    def problems(self, schema: Mapping[str, Any], value: Any, old: Any = None) -> list[str]:
        """Schema problems of a defaulted object, then (if there are none) its failed CEL rules."""
        import jsonschema  # noqa: PLC0415 - the `lab` extra

        found = [
            f"{'.'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
            for error in jsonschema.Draft7Validator(self._checkable(schema)).iter_errors(value)
        ]
        if not found:  # as in the API server, rules only run on a structurally valid object
            self._rules(schema, value, old, "", found)
        return found

    def _checkable(self, schema: Mapping[str, Any]) -> Any:
        found = self._checked.get(id(schema))
        if found is None:
            found = self._checked[id(schema)] = (schema, _checkable(schema))
        return found[1]

    def _rules(self, schema: Mapping[str, Any], value: Any, old: Any, path: str, found: list[str]) -> None:
        """Evaluate the rules attached at `schema` on `value`, then those below it."""
        for rule in schema.get("x-kubernetes-validations") or []:
            transition = RULE_OLD_SELF in rule["rule"]
            if transition and old is None:
                continue  # a transition rule needs an old value at this place
            failure = self._failure(rule, value, old if transition else None)
            if failure is not None:
                where = (path + str(rule.get("fieldPath", ""))).lstrip(".") or "<root>"
                found.append(f"{where}: {failure}")
        if isinstance(value, dict):
            for key, sub in (schema.get("properties") or {}).items():
                if key in value:
                    was = old.get(key) if isinstance(old, dict) else None
                    self._rules(sub, value[key], was, f"{path}.{key}", found)
            extra = schema.get("additionalProperties")
            if isinstance(extra, Mapping):
                for key, item in value.items():
                    if key not in (schema.get("properties") or {}):
                        was = old.get(key) if isinstance(old, dict) else None
                        self._rules(extra, item, was, f"{path}.{key}", found)
        elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
            for index, item in enumerate(value):  # list items are not correlated with old ones (atomic lists)
                self._rules(schema["items"], item, None, f"{path}[{index}]", found)

    def _failure(self, rule: Mapping[str, Any], value: Any, old: Any) -> str | None:
        """The rule's message if it does not hold; the evaluation error if it cannot be evaluated
        (the API server refuses the object then too, naming the rule)."""
        import celpy  # noqa: PLC0415 - the `lab` extra
        import celpy.adapter  # noqa: PLC0415

        text = rule["rule"]
        program = self._programs.get(text)
        if program is None:
            env = celpy.Environment()
            program = self._programs[text] = env.program(env.compile(text))
        activation = {"self": celpy.adapter.json_to_cel(value)}
        if old is not None:
            activation[RULE_OLD_SELF] = celpy.adapter.json_to_cel(old)
        try:
            result = program.evaluate(activation)
        except Exception as exc:  # celpy raises its own types for a rule that does not apply
            return f"rule {text!r} could not be evaluated: {exc}"
        if isinstance(result, Exception):  # celpy returns some evaluation errors as values
            return f"rule {text!r} could not be evaluated: {result}"
        return None if bool(result) else str(rule.get("message") or f"failed rule: {text}")
