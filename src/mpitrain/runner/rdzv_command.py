"""Which commands a node agent agrees to start: the MPI launcher's own daemon, nothing else.

The job's launcher hands each node the command it would have given ssh.  Open MPI's (PRRTE's)
is a few environment settings and its daemon::

    PRTE_PREFIX=/opt/venv;export PRTE_PREFIX;LD_LIBRARY_PATH=/opt/venv/lib:$LD_LIBRARY_PATH;
    export LD_LIBRARY_PATH;/opt/venv/bin/prted --prtemca ess "env" ...

and MPICH's (Hydra's) is its proxy alone: ``"/opt/venv/bin/hydra_pmi_proxy" --control-port
...``.  An agent runs the command through ``/bin/sh`` as sshd would, so it checks first that
the command is of that shape: settings of a few known variables, then one of the two daemons,
with no command substitution, pipe, redirection or second command anywhere.  A forged request
cannot run a program of its choosing this way; it can still start a daemon with arguments of
its choosing, which is why the connection that carries the request is authenticated
(:mod:`.rdzv_wire`; docs/guide/rendezvous.md, "Security").
"""

from __future__ import annotations

import os
import shlex

DAEMONS = ("prted", "hydra_pmi_proxy")
# The variables PRRTE sets before its daemon (its install prefix and library paths).
SETTABLE = ("PRTE_PREFIX", "PMIX_PREFIX", "OPAL_PREFIX", "LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH",
            "PATH")
_SHELL_OPERATORS = set("|&<>()")


def _check_setting(words: list[str]) -> str | None:
    """Why one ``;``-separated statement before the daemon is not a known setting, or None."""
    if len(words) == 2 and words[0] == "export" and words[1] in SETTABLE:
        return None
    if len(words) == 1 and "=" in words[0]:
        name, _, value = words[0].partition("=")
        if name not in SETTABLE:
            return f"it sets {name!r}, which is none of {', '.join(SETTABLE)}"
        # The only expansion allowed is the variable's own old value (PATH=...:$PATH).
        rest = value.replace(f"${name}", "").replace(f"${{{name}}}", "")
        if "$" in rest:
            return f"the value of {name} expands something other than ${name}"
        return None
    return f"{shlex.join(words)!r} is neither a variable setting nor its export"


def problem(command: str) -> str | None:
    """Why ``command`` is not an MPI launcher's daemon command, or None when it is."""
    if "`" in command or "$(" in command or "\n" in command or "\r" in command:
        return "it holds a command substitution or a line break"
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";|&<>()")
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError as exc:  # an unclosed quote
        return f"it does not parse as a shell command ({exc})"
    statements: list[list[str]] = [[]]
    for token in tokens:
        if token == ";":
            statements.append([])
        elif token and set(token) <= _SHELL_OPERATORS | {";"}:
            return f"it holds the shell operator {token!r}"
        else:
            statements[-1].append(token)
    if statements and not statements[-1]:
        statements.pop()
    if not statements:
        return "it is empty"
    for words in statements[:-1]:
        reason = _check_setting(words)
        if reason:
            return reason
    program, *args = statements[-1]
    if os.path.basename(program) not in DAEMONS:
        return f"it runs {program!r}, which is not an MPI launcher's daemon ({', '.join(DAEMONS)})"
    if any("$" in word for word in args):
        return "an argument of the daemon expands a variable"
    return None


__all__ = ["DAEMONS", "SETTABLE", "problem"]
