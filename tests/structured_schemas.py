"""Ten JSON schemas a 135M model completes under greedy decoding within 80 tokens: enums,
nested objects, arrays with min/max items, bounded numbers, required and optional keys, all with
``additionalProperties: false`` (shared by the engine and API tests of structured outputs)."""

SCHEMAS = [
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "admin": {"type": "boolean"}}, "required": ["id", "admin"],
            "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1,
        "maxItems": 3}}, "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10},
                                      "passed": {"type": "boolean"}},
     "required": ["score", "passed"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 16},
                                      "year": {"type": "integer", "minimum": 1900,
                                               "maximum": 2030},
                                      "subtitle": {"type": "string", "maxLength": 10}},
     "required": ["title", "year"], "additionalProperties": False},
    {"type": "object", "properties": {"points": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "object", "properties": {"x": {"type": "integer", "minimum": -9,
                                                   "maximum": 9},
                                             "y": {"type": "integer", "minimum": -9,
                                                   "maximum": 9}},
            "required": ["x", "y"], "additionalProperties": False}}},
     "required": ["points"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error"]},
                                      "code": {"type": "integer", "enum": [200, 404, 500]}},
     "required": ["status", "code"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
     "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 15},
        "location": {"type": "object", "properties": {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180}},
            "required": ["lat", "lon"], "additionalProperties": False},
        "country": {"enum": ["FR", "DE", "US"]}},
     "required": ["city", "location", "country"], "additionalProperties": False},
]
