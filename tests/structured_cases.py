"""Twenty small JSON Schemas with matching prompts for the structured-output tests on SmolLM2:
nested objects, arrays, enums, bounded numbers, strings with patterns, required and optional
fields. Each is small enough that a complete answer fits in ``MAX_TOKENS`` tokens."""

from __future__ import annotations

MAX_TOKENS = 56

_STR = {"type": "string", "maxLength": 24}
_NAME = {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"}

CASES: list[tuple[str, dict]] = [
    ("A person named Alice who is 30 years old: keys name and age.",
     {"type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
      "required": ["name", "age"], "additionalProperties": False}),
    ("The colour of the sky on a clear day: key color, one of red, green, blue.",
     {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}),
    ("Three small prime numbers: key primes, a list of integers.",
     {"type": "object", "properties": {"primes": {"type": "array", "items": {"type": "integer", "minimum": 2,
      "maximum": 50}, "minItems": 3, "maxItems": 3}}, "required": ["primes"], "additionalProperties": False}),
    ("The city Paris and its country: keys city and country.",
     {"type": "object", "properties": {"city": _NAME, "country": _NAME}, "required": ["city", "country"],
      "additionalProperties": False}),
    ("A book: key book with title and year.",
     {"type": "object", "properties": {"book": {"type": "object", "properties": {"title": _STR,
      "year": {"type": "integer", "minimum": 1400, "maximum": 2030}}, "required": ["title", "year"],
      "additionalProperties": False}}, "required": ["book"], "additionalProperties": False}),
    ("Is water wet? key answer, true or false.",
     {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"],
      "additionalProperties": False}),
    ("The temperature of boiling water in Celsius: key celsius, a number.",
     {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 150}},
      "required": ["celsius"], "additionalProperties": False}),
    ("A US phone number: key phone, formatted like 555-123-4567.",
     {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{3}-[0-9]{4}$"}},
      "required": ["phone"], "additionalProperties": False}),
    ("Two fruits: key fruits, a list of lowercase words.",
     {"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string",
      "pattern": "^[a-z]{2,12}$"}, "minItems": 2, "maxItems": 2}}, "required": ["fruits"],
      "additionalProperties": False}),
    ("A point with x 3 and y 4: keys x and y.",
     {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"],
      "additionalProperties": False}),
    ("A user with username bob and an optional email: keys username and email.",
     {"type": "object", "properties": {"username": {"type": "string", "pattern": "^[a-z]{2,10}$"},
      "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}}, "required": ["username"],
      "additionalProperties": False}),
    ("A dog's name and breed: key pet with name and breed.",
     {"type": "object", "properties": {"pet": {"type": "object", "properties": {"name": _NAME, "breed": _STR},
      "required": ["name"], "additionalProperties": False}}, "required": ["pet"], "additionalProperties": False}),
    ("A date: key date in the format YYYY-MM-DD.",
     {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
      "required": ["date"], "additionalProperties": False}),
    ("The size of a T-shirt: key size, one of S, M, L, XL, and key price in dollars.",
     {"type": "object", "properties": {"size": {"enum": ["S", "M", "L", "XL"]},
      "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 100}}, "required": ["size", "price"],
      "additionalProperties": False}),
    ("A rating from 1 to 5 for a good movie: key stars.",
     {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5}},
      "required": ["stars"], "additionalProperties": False}),
    ("A hex colour code for red: key hex like #ff0000.",
     {"type": "object", "properties": {"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
      "required": ["hex"], "additionalProperties": False}),
    ("A matrix with two rows of two integers: key rows.",
     {"type": "object", "properties": {"rows": {"type": "array", "items": {"type": "array", "items":
      {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}},
      "required": ["rows"], "additionalProperties": False}),
    ("A task: key title, key done (true or false) and optional key priority, one of low or high.",
     {"type": "object", "properties": {"title": _STR, "done": {"type": "boolean"}, "priority": {"enum": ["low", "high"]}},
      "required": ["title", "done"], "additionalProperties": False}),
    ("A list of two people, each with name and age: key people.",
     {"type": "object", "properties": {"people": {"type": "array", "items": {"type": "object", "properties":
      {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["name", "age"],
      "additionalProperties": False}, "minItems": 2, "maxItems": 2}}, "required": ["people"],
      "additionalProperties": False}),
    ("The answer to 6 times 7: key result, an integer, and key unit, null.",
     {"type": "object", "properties": {"result": {"type": "integer"}, "unit": {"type": "null"}},
      "required": ["result"], "additionalProperties": False}),
]


def prompt_for(description: str) -> str:
    """The user message asking for one JSON object."""
    return f"Reply with only a JSON object. {description}"
