"""A corpus of JSON Schemas for the structured-output tests: hand-written ones covering each
supported keyword, plus deterministic random ones (nested objects and arrays, unions, enums,
patterns, formats, bounds, recursion through $defs). Every schema's smallest document is short,
so that a constrained generation can close it within the tests' max_tokens.
"""
import random

PATTERNS = ["^[A-Z]{3}-[0-9]{2,4}$", "^[a-z]+(_[a-z]+)*$", "^\\+?[0-9]{7,12}$", "^(red|green|blue)$",
            "^#[0-9a-fA-F]{6}$", "ab", "^\\w+@\\w+\\.com$", "^[^\\s]{1,8}$", "^(?:x|yz){2}\\d?$"]
FORMATS = ["date", "date-time", "time", "uuid", "email"]

HAND = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "string"},
    {"type": "integer", "minimum": -3, "maximum": 3},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 100},
    {"type": "integer", "exclusiveMinimum": 10},
    {"type": "integer", "maximum": -1000},
    {"type": "boolean"},
    {"type": "null"},
    {"type": ["string", "integer", "null"]},
    {"enum": ["red", "green", "blue", 3, None, True, {"a": [1]}]},
    {"const": {"kind": "fixed", "v": [1, 2]}},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {"type": "array", "prefixItems": [{"type": "string"}, {"type": "number"}], "items": False, "minItems": 2},
    {"type": "array", "prefixItems": [{"const": "head"}], "items": {"type": "boolean"}, "maxItems": 3},
    {"type": "string", "minLength": 3, "maxLength": 6},
    {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "uuid"},
    {"type": "string", "format": "email"},
    {"type": "string", "format": "time"},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string", "maxLength": 3}},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}},
    {"type": "object"},
    {},
    {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "integer", "minimum": 0, "maximum": 9}]},
    {"oneOf": [{"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0, "maximum": 10}},
                "required": ["kind", "r"], "additionalProperties": False},
               {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 5}},
                "required": ["kind", "side"], "additionalProperties": False}]},
    {"type": "string", "nullable": True, "enum": ["a", "b"]},
    {"allOf": [{"type": "object", "properties": {"id": {"type": "integer", "minimum": 1}}, "required": ["id"]}]},
    {"$defs": {"node": {"type": "object", "properties": {"value": {"type": "integer", "minimum": 0, "maximum": 99},
                                                         "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
                        "required": ["value"], "additionalProperties": False}},
     "$ref": "#/$defs/node"},
    {"definitions": {"list": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"head": {"type": "string", "maxLength": 2},
                                                                                          "tail": {"$ref": "#/definitions/list"}},
                                                             "required": ["head", "tail"]}]}},
     "$ref": "#/definitions/list"},
    {"type": "object", "properties": {"tree": {"$ref": "#"}}, "additionalProperties": False},
    {"type": "object", "title": "Person", "description": "annotations are ignored",
     "properties": {"email": {"type": "string", "format": "email"}, "born": {"type": "string", "format": "date"},
                    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                    "score": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 5}, {"type": "null"}], "default": None}},
     "required": ["email", "born", "tags", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error", "pending", "retry", "unknown", "timeout", "cancelled",
                                                          "queued", "running", "done"]},
                                      "code": {"enum": [100, 200, 201, 204, 301, 302, 400, 401, 403, 404, 500, 503]}},
     "required": ["status", "code"]},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string", "pattern": "^[a-z]{1,3}$"},
                                                                 "v": {"type": ["integer", "boolean"]}},
                                "required": ["k", "v"], "additionalProperties": False}, "maxItems": 3},
]


def random_schema(rng, depth=0):
    kinds = ["string", "integer", "number", "boolean", "null", "enum", "const", "union", "nullable"]
    if depth < 3:
        kinds += ["object", "object", "array", "anyOf"]
    k = rng.choice(kinds)
    if k == "string":
        c = rng.random()
        if c < 0.3:
            return {"type": "string", "maxLength": rng.randint(0, 8)}
        if c < 0.5:
            return {"type": "string", "pattern": rng.choice(PATTERNS)}
        if c < 0.65:
            return {"type": "string", "format": rng.choice(FORMATS)}
        if c < 0.8:
            lo = rng.randint(0, 3)
            return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 5)}
        return {"type": "string", "enum": rng.sample(["alpha", "beta", "gamma", "delta", "épsilon", "a\"q", "x\\y", "日本"], 3)}
    if k == "integer":
        s = {"type": "integer"}
        if rng.random() < 0.7:
            lo = rng.randint(-500, 500)
            s["minimum"] = lo
            if rng.random() < 0.7:
                s["maximum"] = lo + rng.randint(0, 2000)
        elif rng.random() < 0.5:
            s["exclusiveMaximum"] = rng.randint(-50, 50)
        return s
    if k == "number":
        s = {"type": "number"}
        if rng.random() < 0.6:
            lo = rng.randint(-10, 10)
            s["exclusiveMinimum" if rng.random() < 0.3 else "minimum"] = lo
            s["exclusiveMaximum" if rng.random() < 0.3 else "maximum"] = lo + rng.randint(1, 20)
        return s
    if k == "boolean":
        return {"type": "boolean"}
    if k == "null":
        return {"type": "null"}
    if k == "enum":
        pool = ["a", "b", "c", 1, 2.5, -7, None, True, False, [1, "x"], {"k": "v"}, "long value with spaces"]
        return {"enum": rng.sample(pool, rng.randint(1, 6))}
    if k == "const":
        return {"const": rng.choice(["fixed", 42, None, [True], {"z": 0}])}
    if k == "union":
        return {"type": rng.sample(["string", "integer", "boolean", "null", "number"], 2)}
    if k == "nullable":
        inner = random_schema(rng, 3)
        if "type" in inner and isinstance(inner["type"], str) and "enum" not in inner:
            inner["nullable"] = True
        return inner
    if k == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(rng.randint(2, 3))]}
    if k == "array":
        s = {"type": "array", "items": random_schema(rng, depth + 1)}
        if rng.random() < 0.3:
            s["prefixItems"] = [random_schema(rng, depth + 1)]
        s["maxItems"] = rng.randint(1, 3)
        if rng.random() < 0.4:
            s["minItems"] = rng.randint(0, 1)
        return s
    props = {}
    for i in range(rng.randint(1, 4)):
        props[rng.choice(["id", "name", "value", "items", "meta", "when", "note", "x", "y", "ok"]) + str(i)] = \
            random_schema(rng, depth + 1)
    s = {"type": "object", "properties": props}
    req = [p for p in props if rng.random() < 0.5]
    if req:
        s["required"] = req
    r = rng.random()
    if r < 0.4:
        s["additionalProperties"] = False
    elif r < 0.5:
        s["additionalProperties"] = {"type": "integer", "minimum": 0, "maximum": 9}
    return s


def recursive_schema(rng):
    leaf = random_schema(rng, 3)
    return {"$defs": {"node": {"type": "object",
                               "properties": {"leaf": leaf,
                                              "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
                               "required": ["kids"], "additionalProperties": False}},
            "type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"]}


def corpus():
    rng = random.Random(20261201)
    out = list(HAND)
    for i in range(70):
        out.append(random_schema(rng))
    for i in range(10):
        out.append(recursive_schema(rng))
    return out
