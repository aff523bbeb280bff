"""The suite's runtime type checks (`--jaxtyping-packages=eqxscan,...`) at a
fraction of their cost to write.

jaxtyping's import hook decorates every function eqxscan defines, nested ones
too, and each decoration writes two checking functions from source (`exec`),
each of which beartype wraps with a checker it writes and compiles as well:
about 1 ms a decoration. A nested function is decorated again on every call of
the function that defines it (and an `eqx.Module`'s fields get a checking
function on every instance), which came to a seventh of the suite's CPU time.

What is written depends only on the name, the parameters (names, kinds,
annotations, defaults) and the return annotation, so here it is written once per
such signature and reused: annotations are compared by equality (hence by what
they check), defaults by identity (the function written holds them, so an id is
never reused). The checks that run on each call are the same functions, called
on the same arguments; nothing is checked less. Anything unhashable, or a
jaxtyping without these private names, is written as before.
"""

import inspect


_LIMIT = 20_000  # signatures remembered; the tables start over past it


def install() -> None:
    try:
        from jaxtyping import _decorator
    except ImportError:
        return
    make = getattr(_decorator, "_make_fn_with_signature", None)
    check = getattr(_decorator, "_apply_typechecker", None)
    if make is None or check is None:
        return
    params = list(inspect.signature(make).parameters)
    if params != ["name", "qualname", "module", "signature", "output"]:
        return
    written: dict = {}
    # The checkers beartype wrote for each function written here, by type checker.
    wrapped: dict = {}

    def make_memo(name, qualname, module, signature, output):
        try:
            key = (
                name,
                qualname,
                module,
                output,
                signature.return_annotation,
                tuple(
                    (p.name, p.kind, p.annotation, id(p.default))
                    for p in signature.parameters.values()
                ),
            )
            found = written.get(key)
        except Exception:  # an unhashable annotation, or one whose == raises
            return make(name, qualname, module, signature, output)
        if found is None:
            if len(written) >= _LIMIT:
                written.clear()
                wrapped.clear()
            found = written[key] = make(name, qualname, module, signature, output)
            wrapped[found[0] if output else found] = {}
        return found

    def check_memo(typechecker, fn):
        by_checker = wrapped.get(fn)
        if by_checker is None:
            return check(typechecker, fn)
        try:
            found = by_checker.get(typechecker)
        except TypeError:  # an unhashable type checker
            return check(typechecker, fn)
        if found is None:
            found = by_checker[typechecker] = check(typechecker, fn)
        return found

    _decorator._make_fn_with_signature = make_memo
    _decorator._apply_typechecker = check_memo
