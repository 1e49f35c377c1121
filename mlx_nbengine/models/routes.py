"""Routes: every place where a model's operations leave the library's code for ours, built on
one mechanism (the routes themselves live in `qroute`, `fastops`, `attnroute`, `cpu_math`,
`layerroute` and `deltaroute`).

Terms:

- *route*: one replacement of library code by ours, named, with the library bodies it
  restates and the library versions they were read from (`checked_with`).
- *restated body* (`Body`): a library function whose body our code restates or relies on
  (a method we replace, the attention it calls, the function that looks ours up). A route
  applies only while every one of its bodies has the digest of the text we restated
  (`body_digest`: the function's statements as a syntax tree, docstring dropped, positions
  left out, so formatting and comments do not count). A route that refuses says so in one
  stderr line, once per process, and the model runs the library's code there.
- *instance route*: the library class keeps its methods; each module of one of the
  engine's models is given a subclass with ours (`patches.subclass_instance`), so the
  user's own MLX code in the same process runs the library's.
- *process route*: where the library looks a function up at call time in a namespace
  (``mx.fast.scaled_dot_product_attention``, ``mx.fast.rms_norm``, ``mx.fast.rope``), the
  function itself is replaced, counted per model that holds it, and the library's is put
  back when the last holder releases it.
- *routing* (`Routing`): what one model holds, its instance swaps and process holds;
  `Routing.release` (``Engine.close``, or the model's collection) gives both back.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import inspect
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any

from mlx_nbengine.models import patches

__all__ = [
    "Body",
    "InstanceRoute",
    "ProcessRoute",
    "Route",
    "Routing",
    "body_digest",
    "registry",
]

_registry: list[Route] = []


def registry() -> tuple[Route, ...]:
    """Every route declared in this process, in declaration order."""
    return tuple(_registry)


def _statements(source: str) -> list[ast.stmt]:
    tree = ast.parse(textwrap.dedent(source))
    statements = tree.body
    if len(statements) == 1 and isinstance(statements[0], ast.FunctionDef | ast.AsyncFunctionDef):
        statements = statements[0].body
    first = statements[0] if statements else None
    if (
        len(statements) > 1
        and isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        statements = statements[1:]  # the docstring
    return statements


def body_digest(source: str) -> str:
    """A digest of a function's body (its whole source, ``def`` line and all) or of a body
    alone: SHA-256 over its statements' syntax trees without positions, so only what it
    computes counts (not formatting, comments or the docstring)."""
    dumped = "\n".join(ast.dump(s, include_attributes=False) for s in _statements(source))
    return hashlib.sha256(dumped.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Body:
    """A library function (`module`, `qualname`) whose body we restate as `source`."""

    module: str
    qualname: str
    source: str

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"

    def library(self) -> Any:
        """The library's function (ImportError where its module is not installed)."""
        found: Any = import_module(self.module)
        for part in self.qualname.split("."):
            found = getattr(found, part)
        return found

    def changed(self) -> bool:
        """Whether the library's body is no longer the one restated (OSError, TypeError,
        AttributeError or SyntaxError where it cannot be read)."""
        return body_digest(inspect.getsource(self.library())) != body_digest(self.source)


# Why a route refuses, by its bodies (so a test that changes them is checked anew); None: fine.
_verdicts: dict[tuple[Body, ...], str | None] = {}
_verdicts_lock = threading.Lock()


@dataclass(eq=False)
class Route:
    """One replacement of library code: `name`, the `bodies` it restates, the library
    versions they were read from (`checked_with`), and the words of its refusal line:
    `refusal` (what is not used) and `fallback` (what runs instead)."""

    name: str
    bodies: tuple[Body, ...]
    checked_with: str
    refusal: str
    fallback: str

    def __post_init__(self) -> None:
        _registry.append(self)

    def present(self) -> bool:
        """Whether every module the route's bodies live in is installed (mlx-vlm may not be)."""
        try:
            for body in self.bodies:
                import_module(body.module)
        except ImportError:
            return False
        return True

    def refused(self) -> str | None:
        """Why the route does not apply in this process (a body changed or cannot be read),
        else None; the first time, said in one line on stderr."""
        key = self.bodies
        with _verdicts_lock:
            if key in _verdicts:
                return _verdicts[key]
            reason = None
            for body in self.bodies:
                try:
                    changed = body.changed()
                except (ImportError, AttributeError, OSError, TypeError, SyntaxError) as exc:
                    reason = f"{body.name} cannot be read ({type(exc).__name__}: {exc})"
                    break
                if changed:
                    reason = (
                        f"{body.name} is not the body restated (route {self.name}, "
                        f"read from {self.checked_with})"
                    )
                    break
            _verdicts[key] = reason
        if reason is not None:
            print(f"mlx_nbengine: {self.refusal}: {reason}; {self.fallback}", file=sys.stderr)
        return reason


@dataclass(eq=False)
class InstanceRoute(Route):
    """A route of one library class's instances: each is given the subclass whose methods
    are `methods` (named `prefix` + the class's name); the class itself is never changed.
    The class is the one owning the first body's method."""

    methods: dict[str, Callable[..., Any]] = field(default_factory=dict)
    prefix: str = "Routed"
    _subclass: type | None = field(default=None, init=False, repr=False)

    def library_class(self) -> type:
        body = self.bodies[0]
        owner: Any = import_module(body.module)
        for part in body.qualname.split(".")[:-1]:
            owner = getattr(owner, part)
        return owner

    def subclass(self) -> type:
        """The routed subclass of the library class (made once)."""
        if self._subclass is None:
            cls = self.library_class()
            self._subclass = type(f"{self.prefix}{cls.__name__}", (cls,), dict(self.methods))
        return self._subclass

    def routes(self, module: Any) -> bool:
        """Whether `module` runs this route's code (its class is the routed subclass)."""
        return self._subclass is not None and type(module) is self._subclass


@dataclass(eq=False)
class ProcessRoute(Route):
    """A route of functions of a namespace (``mx.fast``) the library looks up at call time:
    `replacements` by attribute name; `probe`, when given, compares ours with the library's
    on a small case before the first hold (a string says what disagrees: the route refuses,
    in one line that begins with `refusal`). The library's functions are kept from when the
    route is declared (before any model holds it)."""

    namespace: Any = None
    replacements: dict[str, Callable[..., Any]] = field(default_factory=dict)
    probe: Callable[[], str | None] | None = None
    library: dict[str, Callable[..., Any]] = field(default_factory=dict, init=False)
    holders: int = field(default=0, init=False)
    _probed: list[str | None] = field(default_factory=list, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.library = {name: getattr(self.namespace, name) for name in self.replacements}

    def probe_fails(self) -> str | None:
        """What disagrees with the library (`probe`, once per process), else None."""
        with self._lock:
            if self.probe is not None and not self._probed:
                try:
                    wrong = self.probe()
                except Exception as e:  # noqa: BLE001 - a kernel problem must never stop a model
                    wrong = f"{type(e).__name__}: {e}"
                self._probed.append(wrong)
                if wrong is not None:
                    print(f"mlx_nbengine: {self.refusal} ({wrong} disagrees)", file=sys.stderr)
            return self._probed[0] if self._probed else None

    def held(self) -> bool:
        """Whether a model holds the route now (the namespace has our functions)."""
        return self.holders > 0

    def acquire(self) -> None:
        with self._lock:
            if self.holders == 0:
                for name, replacement in self.replacements.items():
                    setattr(self.namespace, name, replacement)
            self.holders += 1

    def release(self) -> None:
        with self._lock:
            if self.holders == 0:
                return
            self.holders -= 1
            if self.holders == 0:
                for name, function in self.library.items():
                    setattr(self.namespace, name, function)

    @contextlib.contextmanager
    def library_functions(self) -> Iterator[None]:
        """The library's functions in the namespace for the duration, whoever holds the route
        (comparisons in tests and benchmarks; nothing else may run meanwhile)."""
        with self._lock:
            for name, function in self.library.items():
                setattr(self.namespace, name, function)
        try:
            yield
        finally:
            with self._lock:
                if self.holders:
                    for name, replacement in self.replacements.items():
                        setattr(self.namespace, name, replacement)


class Routing:
    """The routes one model holds: its instance swaps and its process holds. `release`
    gives both back (idempotent); `suspended` runs the library's code for a while."""

    def __init__(self) -> None:
        self._swaps: list[tuple[InstanceRoute, Any]] = []
        self._holds: list[ProcessRoute] = []
        self._released = False
        self._lock = threading.Lock()

    def usable(self, route: Route) -> bool:
        """Whether `route` may apply here: its library is installed and it does not refuse
        (a refusal said once); a process route's probe agrees too."""
        if not route.present() or route.refused() is not None:
            return False
        return not (isinstance(route, ProcessRoute) and route.probe_fails() is not None)

    def swap(
        self, route: InstanceRoute, model: Any, where: Callable[[Any], bool] | None = None
    ) -> int:
        """Give every module of `model` whose class is the route's library class (and that
        `where` accepts) the routed subclass, where the route is usable. Returns how many.
        A class whose module was never imported has no instances: nothing is imported for it
        (mlx-vlm's modules cost seconds)."""
        if route.bodies[0].module not in sys.modules or not route.present():
            return 0
        cls = route.library_class()
        found = [m for _, m in model.named_modules() if type(m) is cls]
        found = [m for m in found if where is None or where(m)]
        if not found or not self.usable(route):
            return 0
        subclass = route.subclass()
        with self._lock:
            for module in found:
                patches.subclass_instance(module, subclass)
                self._swaps.append((route, module))
        return len(found)

    def hold(self, route: ProcessRoute) -> bool:
        """Hold `route` for this model where it is usable. Returns whether it is held."""
        if not self.usable(route):
            return False
        with self._lock:
            if route not in self._holds:
                route.acquire()
                self._holds.append(route)
        return True

    def names(self) -> tuple[str, ...]:
        """The names of the routes this model runs now."""
        if self._released:
            return ()
        seen = [route.name for route, _ in self._swaps] + [r.name for r in self._holds]
        return tuple(dict.fromkeys(seen))

    def release(self) -> None:
        """Give every swapped module its library class back and release every process hold."""
        with self._lock:
            if self._released:
                return
            self._released = True
            for route, module in reversed(self._swaps):
                patches.unsubclass_instance(module, route.library_class())
            for route in reversed(self._holds):
                route.release()

    @contextlib.contextmanager
    def suspended(self, *routes: Route) -> Iterator[None]:
        """This model on the library's code for `routes` (all of them when none is named) for
        the duration: its swapped modules get their library class back, and a process route's
        namespace the library's functions, whoever else holds it (comparisons in tests and
        benchmarks)."""
        chosen = set(routes) if routes else None
        swaps = [(r, m) for r, m in self._swaps if chosen is None or r in chosen]
        holds = [r for r in self._holds if chosen is None or r in chosen]
        for route, module in swaps:
            patches.unsubclass_instance(module, route.library_class())
        with contextlib.ExitStack() as stack:
            for route in holds:
                stack.enter_context(route.library_functions())
            try:
                yield
            finally:
                if not self._released:
                    for route, module in swaps:
                        patches.subclass_instance(module, route.subclass())
