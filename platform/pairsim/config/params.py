"""Sections whose entry is chosen by name from a registry and owns its parameters, written flat
beside the name (``loss.base: unified`` with ``loss.margin``), and how layering drops the
parameters of an entry a later layer replaces."""

from __future__ import annotations

import typing
from typing import Any, ClassVar

from pydantic import BaseModel, ValidationError, model_serializer, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError, PydanticUndefined

from pairsim.config.fields import Section
from pairsim.registry import Registry

def params_of(registry: Registry, name: Any) -> type[Section] | None:
    """The ``Params`` of the entry registered as ``name``; None for a name that is not registered."""
    return registry[name].Params if isinstance(name, str) and name in registry else None


def _relocated(err: ValidationError) -> list[InitErrorDetails]:
    """``err``'s errors, to raise again from a wrap validator: same type, message, place and input."""
    return [{"type": PydanticCustomError(e["type"], e["msg"]), "loc": tuple(e["loc"]), "input": e["input"]}
            for e in err.errors()]


class WithParams(Section):
    """A section whose entry (a base loss, a structure, a teacher) is chosen by name from a
    :class:`~pairsim.registry.Registry` and owns its parameters: the entry's ``Params`` model.

    Written flat, as the user writes it (``loss.margin``, not ``loss.base_params.margin``): on
    validation the keys the chosen entries' ``Params`` know are split off and validated into
    the params fields; keys that belong to another entry of the registry are refused naming the
    chosen one; keys nobody knows stay unknown keys. Dumps put the params back flat after the
    selectors, so a dump re-validates to an equal section.
    """

    # (params field, selector field, registry, how errors name the selector), in dump order
    param_slots: ClassVar[tuple[tuple[str, str, Registry, str], ...]] = ()

    @model_validator(mode="wrap")
    @classmethod
    def _split_params(cls, data: Any, handler):
        if not isinstance(data, dict):
            return handler(data)
        given, data, errors = data, dict(data), []
        chosen = {}
        for params_field, selector, registry, _ in cls.param_slots:
            default = cls.model_fields[selector].default
            name = data.get(selector, None if default is PydanticUndefined else default)
            chosen[params_field] = params_of(registry, name), name
            params = data.pop(params_field, None)  # a params object or dict passed programmatically
            data[params_field] = (params.model_dump() if isinstance(params, BaseModel)
                                  else dict(params) if isinstance(params, dict) else {})
        for key in [k for k in data if k not in cls.model_fields]:
            owner = next((f for f, (params, _) in chosen.items() if params and key in params.model_fields), None)
            if owner is not None:
                data[owner][key] = data.pop(key)
                continue
            for params_field, _, registry, what in cls.param_slots:
                others = [n for n, entry in registry.items() if key in entry.Params.model_fields]
                if not others:
                    continue
                params, name = chosen[params_field]
                if params is None:  # the selector is wrong: that is the error to report
                    data.pop(key)
                    break
                own = ", ".join(params.model_fields) or "none"
                message = (f"not a parameter of {what} {name!r} (its parameters: {own}; "
                           f"{key} belongs to {', '.join(map(repr, others))})")
                errors.append({"type": PydanticCustomError("not_a_parameter", message), "loc": (key,),
                               "input": data.pop(key)})
                break
        for params_field, (params, _) in chosen.items():
            raw = data[params_field]
            if params is None:
                data[params_field] = Section.model_construct()
                continue
            try:
                data[params_field] = params.model_validate(raw)
            except ValidationError as exc:
                errors += _relocated(exc)  # flat: loss.margin, not loss.base_params.margin
                data[params_field] = params.model_construct()
        try:
            section = handler(data)
        except ValidationError as exc:
            # errors about the whole section (a missing key) show what was written, not the split
            errors += [e | {"input": given} if e["input"] is data else e for e in _relocated(exc)]
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return section

    @model_serializer(mode="wrap")
    def _flat_params(self, handler) -> dict[str, Any]:
        tree = handler(self)
        params = [tree.pop(f, {}) for f, *_ in self.param_slots]
        selectors = [key for key in tree if key in {selector for _, selector, *_ in self.param_slots}]
        out = {}
        for key, value in tree.items():
            out[key] = value
            if selectors and key == selectors[-1]:  # structure, base, margin, gamma, ...
                for values in params:
                    out |= values
        return out


def _section_model(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    """The section model of ``model``'s field ``key`` (``LossConfig | None`` → LossConfig), if any."""
    field = model.model_fields.get(key)
    if field is None:
        return None
    for kind in (field.annotation, *typing.get_args(field.annotation)):
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            return kind
    return None


def drop_replaced_params(tree: Any, overlay: Any, model: type[BaseModel]) -> Any:
    """``tree`` (the layers so far) without the parameters of entries ``overlay`` (the next
    layer) replaces: where it names another ``loss.base``, ``loss.structure`` or teacher
    ``kind``, the earlier layers' keys that belong to other entries of that registry and not to
    the new one are dropped (``demo.yaml``'s ``margin`` under an objective with ``base: infonce``).
    Keys written in the same layer as the new name are kept, so they are still refused."""
    if not isinstance(tree, dict) or not isinstance(overlay, dict):
        return tree
    tree = dict(tree)
    if issubclass(model, WithParams):
        for _, selector, registry, _ in model.param_slots:
            default = model.model_fields[selector].default
            if selector not in overlay or overlay[selector] == tree.get(selector, default):
                continue
            new = params_of(registry, overlay[selector])
            owned = set(new.model_fields) if new else set()
            anyones = {key for _, entry in registry.items() for key in entry.Params.model_fields}
            tree = {k: v for k, v in tree.items() if k not in anyones - owned}
    for key, value in overlay.items():
        section = _section_model(model, key)
        if section is not None and key in tree:
            tree[key] = drop_replaced_params(tree[key], value, section)
    return tree
