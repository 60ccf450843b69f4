"""JSON schemas that constrained generation is tested against."""

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "ok": {"type": "boolean"},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 5},
                    "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "tags", "address"],
        "additionalProperties": False,
    },
    "numbers_and_optional_keys": {
        "type": "object",
        "properties": {
            # a random model writes digits forever where a schema lets it: numbers are bounded, fractions too
            "score": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.25},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
            "note": {"type": "string", "maxLength": 4},
        },
        "required": ["score"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}, "kind": {"const": "x"}},
            "required": ["id", "kind"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 2,
    },
}
