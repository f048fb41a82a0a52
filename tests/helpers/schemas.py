"""Random JSON schemas for the constrained-decoding tests (tests/test_constrain.py, tests/test_serve.py)."""


def random_schema(rng, depth: int = 0, kind: str | None = None) -> dict:
    """A JSON schema of the kinds apps send, every string, array and number bounded, so that any reply the
    grammar allows ends within a few hundred tokens: objects with required and optional properties, enums,
    consts, integers in ranges, booleans, nulls, patterns, arrays, anyOf, nesting."""
    kinds = ["string", "enum", "integer", "boolean", "pattern", "null", "const"]
    if depth < 2:
        kinds += ["object", "array", "anyOf"]
    kind = kind or str(rng.choice(kinds))
    if kind == "string":
        return {"type": "string", "maxLength": int(rng.integers(0, 6))}
    if kind == "enum":
        return {"enum": [str(w) for w in rng.choice(["red", "green", "blue", "yes", "no", "maybe"],
                                                     int(rng.integers(1, 4)), replace=False)]}
    if kind == "integer":
        low = int(rng.integers(-50, 50))
        return {"type": "integer", "minimum": low, "maximum": low + int(rng.integers(0, 200))}
    if kind == "pattern":
        return {"type": "string", "pattern": "^[A-Z][a-z]{1,3}[0-9]?$"}
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "const":
        return {"const": "fixed"}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": int(rng.integers(0, 2)),
                "maxItems": int(rng.integers(2, 4))}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1), random_schema(rng, depth + 1)]}
    names = [f"p{i}" for i in range(int(rng.integers(1, 4)))]
    return {"type": "object", "additionalProperties": False,
            "properties": {name: random_schema(rng, depth + 1) for name in names},
            "required": [n for n in names if rng.random() < 0.7]}
