"""A request's fields as a typer command: the one place the CLI's options are derived from their declarations
(dpltm.options), as open_lth derives its flags from its hparams. The command's signature is built from the
request's fields, so typer parses, checks choices and bounds, and writes `--help` from the same `Flag`s."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

from dpltm.options import Flag, flag_of
from dpltm.stages.requests import CommandRequest

R = TypeVar("R", bound=CommandRequest)


def _annotation(flag: Flag, hint: Any) -> Any:
    """The type typer parses a field with: its enum for a field of plain choices, a list for a tuple."""
    if typing.get_origin(hint) is tuple:
        return list[flag.choices or typing.get_args(hint)[0]]  # type: ignore[misc]
    if flag.choices is None:
        return hint
    return flag.choices | None if type(None) in typing.get_args(hint) else flag.choices


def _parameter(field: dataclasses.Field[Any], flag: Flag, hint: Any) -> inspect.Parameter:
    details = {"help": flag.help, "show_default": flag.show_default(), "metavar": flag.metavar}
    info = (typer.Argument(**details) if flag.argument
            else typer.Option(*flag.decls, **details, min=flag.min, max=flag.max))
    default = field.default
    if default is dataclasses.MISSING:
        default = inspect.Parameter.empty
    elif flag.choices is not None and isinstance(default, str):
        default = flag.choices(default)
    return inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[_annotation(flag, hint), info])


def parameters(request_type: type[CommandRequest]) -> list[inspect.Parameter]:
    """The command-line parameters of a request's flagged fields, in their order."""
    hints = typing.get_type_hints(request_type)
    return [_parameter(f, flag, hints[f.name]) for f in dataclasses.fields(request_type)
            if (flag := flag_of(f)) is not None]


def request_command(request_type: type[R]) -> Callable[[Callable[[R], None]], Callable[..., None]]:
    """A command function for typer whose options are `request_type`'s fields: it parses them into the request
    and hands it to the decorated body (whose name and docstring name and describe the command)."""

    def decorate(body: Callable[[R], None]) -> Callable[..., None]:
        def command(ctx: typer.Context, **options: Any) -> None:
            given = frozenset(name for name in options
                              if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE")
            body(request_type.from_options(options, given))

        context = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
        command.__signature__ = inspect.Signature([context, *parameters(request_type)])  # type: ignore[attr-defined]
        command.__name__, command.__qualname__, command.__doc__ = body.__name__, body.__qualname__, body.__doc__
        command.__module__ = body.__module__
        return command

    return decorate
