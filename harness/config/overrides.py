"""The overrides of the runner's and the analytic CLI's command lines, as Hydra reads them, and Hydra's
and OmegaConf's refusals of them said as one line naming the key and the form allowed. Hydra's own
answers name no fix, or worse:

- an override its grammar cannot read (a non-ASCII letter, a stray ';' or ')') is answered with its
  lexer's exception and the whole override (`LexerNoViableAltException: strategy=contigüous`);
- a config group given a list is read as several options merged into one node (`model=[tiny,cpu_small]`
  ran cpu_small's shape), a mapping as an unknown key;
- a list or a mapping where the schema takes one value (`batch=[1,2]`) is answered with OmegaConf's
  conversion (`Cannot convert 'dict' to string`);
- `+key=value` for a key the config has, null for a key that takes none.

Each CLI passes what differs: its config groups (each picks one option by name), how it lists a
group's options, and whether it sweeps (the runner's `-m`).
"""
from __future__ import annotations

import re
import typing
from typing import Any, Callable, Iterable, Optional

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep
from hydra.errors import HydraException

from harness.config.schema import field_type
from harness.config.validate import ConfigError, first_line, target_class

SCHEMA_SUFFIX = "_schema"  # harness.config.schema.register_schemas' entries: schemas, not options of a group
# What Hydra's grammar reads unquoted (hydra/grammar/OverrideLexer.g4), and the forms it gives a value.
VALUE_FORM = ("a value is letters, digits and _-+.:/@$%*?|\\ (any other character inside quotes: "
              "{key}='...'), a list [a,b] or a mapping {{k:v}}")
KEY_FORM = "a key is letters, digits, '_' and '-', dotted for a nested key (model.n_layers)"
KINDS = {int: "integer", float: "number", bool: "boolean (true or false)", str: "string"}


def named_options(options: Iterable[str]) -> list[str]:
    """A group's options as a user picks them: sorted, the schemas left out."""
    return sorted(option for option in options if not option.endswith(SCHEMA_SUFFIX))


def allowed(options: Iterable[str]) -> str:
    return f"allowed: {', '.join(named_options(options))}"


def unknown_option(group: str, option: str, options: Iterable[str]) -> ConfigError:
    """`model=foo` -> "model: unknown option 'foo', allowed: cpu_small, llama3_8b, ..."."""
    return ConfigError(group, f"unknown option '{option}', {allowed(options)}")


def parsed_overrides(parser: OverridesParser, overrides: list[str], groups: tuple[str, ...], options: Callable[[str], list[str]],
                     sweeps: bool, usage: str = "", schema: Optional[type] = None) -> list:
    """Each override as Hydra's `parser` reads it, ConfigError on the first its grammar cannot read, that
    gives one of `groups` anything but an option's name, that gives a boolean key of `schema` anything
    but true or false, or (where the command does not sweep) that is a sweep. `options(group)`: the
    group's options; `sweeps`: the command takes `-m key=a,b`; `usage`: where its keys are listed."""
    found = []
    for override in overrides:
        try:  # one at a time: parse_overrides' own refusal names the lexer's exception, not the character
            parsed = parser.parse_override(override)
        except HydraException as error:
            raise unreadable(parser.parse_override, override, error, groups, options, usage) from None
        parsed.config_loader = parser.config_loader  # as parse_overrides sets it: a glob() sweep lists options through it
        if parsed.is_sweep_override() and not sweeps:
            raise ConfigError(parsed.get_key_element().lstrip("+~"), "several values are a sweep, and this command "
                                                                      "takes one: give one value")
        if parsed.key_or_group in groups and not parsed.is_delete():
            value = parsed.value()  # a sweep's values each name one option too (a glob() names options)
            for one in value.list if isinstance(value, ChoiceSweep) else [] if parsed.is_sweep_override() else [value]:
                one_option(parsed.key_or_group, one, options, sweeps)
        if schema is not None and not parsed.is_delete() and field_type(parsed.key_or_group, schema) is bool:
            one_boolean(parsed)
        found.append(parsed)
    return found


def one_boolean(parsed) -> None:
    """A boolean key takes true or false: OmegaConf would read `2`, `-1` or `yes` as true, and a row
    would then claim a switch that was never asked for. (An interpolation is typed where it resolves; a
    list, a mapping or null is said by composition_refusal.)"""
    value = parsed.value()
    if isinstance(value, ChoiceSweep):
        values = value.list
    elif parsed.is_sweep_override():  # range() or interval(): numbers
        raise ConfigError(parsed.key_or_group, f"takes a boolean (true or false), got {parsed.input_line.split('=', 1)[1]}")
    else:
        values = [value]
    for one in values:
        if isinstance(one, (bool, list, dict)) or one is None or (isinstance(one, str) and one.startswith("${")):
            continue
        shown = f"'{one}' (a string)" if isinstance(one, str) else repr(one)
        raise ConfigError(parsed.key_or_group, f"takes a boolean (true or false), got {shown}")


def unreadable(parse: Callable, override: str, error: HydraException, groups: tuple[str, ...],
               options: Callable[[str], list[str]], usage: str) -> ConfigError:
    """An override Hydra's grammar cannot read, said on its key with the form allowed (a group's option
    cannot be quoted into existence: its options are said instead)."""
    key, equals, value = override.partition("=")
    name = key.lstrip("+~").split("@")[0] or override
    if not equals:
        return ConfigError(override, f"expected key=value{usage}")
    found = re.search(r"(?:at: |input )'(.*?)'", first_line(error, typed=False))
    where = f" (Hydra's override grammar stops at '{found.group(1)}')" if found else ""
    try:
        parse(f"{key}=0")
    except HydraException:
        return ConfigError(name, f"cannot be read as a key{where}: {KEY_FORM}{usage}")
    if name in groups and value not in (known := options(name)):
        return unknown_option(name, value, known)
    return ConfigError(name, f"cannot read '{value}'{where}: {VALUE_FORM.format(key=name)}")


def one_option(group: str, value: Any, options: Callable[[str], list[str]], sweeps: bool) -> None:
    """A config group picks one option by name: a list would merge several, a mapping or null is no option."""
    if value is None:
        raise ConfigError(group, f"cannot be null: a config group takes one of its options by name, {allowed(options(group))}")
    if isinstance(value, list):  # the sweep's hint last, as for a key of one value (composition_refusal)
        raise ConfigError(group, f"a list is not a {group}: name one option, {allowed(options(group))}"
                                 f"{'; ' + sweep_hint(group, value) if sweeps else ''}")
    if isinstance(value, dict):
        raise ConfigError(group, f"a mapping is not a {group}: name one option and set its options one by one "
                                 f"({group}.<option>=value), {allowed(options(group))}")


def sweep_hint(key: str, values: list) -> str:
    """How the runner takes several values of `key`: the list's own where it has several plain ones."""
    plain = len(values) > 1 and all(isinstance(v, (str, int, float)) for v in values)
    return f"a sweep over several is -m {key}={','.join(map(str, values)) if plain else 'a,b'}"


def composition_refusal(error: BaseException, sweeps: bool) -> Optional[ConfigError]:
    """Hydra's and OmegaConf's composition refusals (the error or its cause) whose words name no fix,
    said on the key with what is allowed; None for any other."""
    for raised in (error, error.__cause__):
        if raised is None:
            continue
        message = first_line(raised, typed=False)
        found = re.search(r"Could not append to config\. An item is already at '([^']+)'", message)
        if found:
            return ConfigError(found.group(1), "is a key already: set it without '+'")
        found = re.search(r"field '([^']+)' is not Optional", message)
        if found:
            return ConfigError(found.group(1), "cannot be null: give it a value")
        value, key = getattr(raised, "value", None), getattr(raised, "full_key", None)
        if isinstance(value, (list, dict)) and key:  # OmegaConf's conversion of a container to a scalar field
            what = "a list" if isinstance(value, list) else "a mapping"
            hint = f"; {sweep_hint(key, value)}" if sweeps and isinstance(value, list) else ""
            return ConfigError(key, f"takes one {_kind(raised)}, not {what} ({value!r}){hint}")
    return None


def defaults_list_hint(error: BaseException) -> Optional[ConfigError]:
    """`sweep=kv_compression` for a group the defaults list does not hold: Hydra's own hint (its
    message's second line, `+sweep=...`) kept on the key."""
    found = re.match(r"Could not override '([^']+)'\. No match in the defaults list\.\s*To append to your default "
                     r"list use (\S+)", " ".join(str(error).split()))
    if found:
        return ConfigError(found.group(1), f"is not in the defaults list: add it with {found.group(2)}")
    return None


def strategy_option_refusal(key: str, overrides: list[str], compose: Callable[[list[str]], Any]) -> Optional[ConfigError]:
    """`strategy.<option>=` that the chosen strategy does not take (Hydra's answer: "Could not override"),
    said with the options its class does take (strategies.base.Strategy.no_such_option): the config
    composed without the strategy's options names the class. `compose(overrides)`: the CLI's composed
    config. None where that cannot tell (the class takes the option: another refusal applies)."""
    if not key.startswith("strategy."):
        return None
    option = key.split(".")[1]
    plain = [o for o in overrides if not o.lstrip("+~").startswith("strategy.")]
    try:
        cls = target_class("strategy._target_", compose(plain).strategy.get("_target_"))
    except Exception:  # noqa: BLE001 - the composition's own refusal says it
        return None
    if not hasattr(cls, "no_such_option") or option in cls.option_names():
        return None
    return cls.no_such_option(option, chosen_option("strategy", overrides))


def chosen_option(group: str, overrides: list[str]) -> Optional[str]:
    """The option of `group` the overrides pick (the last `group=name`), None where they pick none."""
    return next((o.split("=", 1)[1] for o in reversed(overrides) if o.lstrip("+").split("=", 1)[0] == group), None)


def _kind(raised: BaseException) -> str:
    """What the field OmegaConf refused a value for takes, from its schema's annotation."""
    try:
        hint = typing.get_type_hints(getattr(raised, "object_type", None)).get(getattr(raised, "key", None))
    except Exception:  # noqa: BLE001 - no schema to read: the answer says "value"
        hint = None
    hint = next((a for a in typing.get_args(hint) if a is not type(None)), hint)  # Optional[int] -> int
    return KINDS.get(hint, "value")
