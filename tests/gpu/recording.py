"""Records which captured path a step took: calls to a graph runner's method."""


def record_calls(obj, name: str) -> list:
    """Wraps obj.name (a method) so that each call appends its first argument
    to the returned list."""
    calls, method = [], getattr(obj, name)

    def recording(first, *args, **kwargs):
        calls.append(first)
        return method(first, *args, **kwargs)

    setattr(obj, name, recording)
    return calls
