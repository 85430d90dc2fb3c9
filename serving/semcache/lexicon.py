"""The vocabulary the semantic cache's verifier normalises (serving.semcache.verify): number
words, currencies and units, written the same on both sides of a comparison. Standard English,
not a list of traps: the verifier is conservative by construction, not by foreseeing words.
"""

from __future__ import annotations


def words(text: str) -> frozenset[str]:
    return frozenset(text.split())


def words_in_order(text: str) -> list[str]:
    return text.split()


NUMBER_WORDS = {
    word: number
    for number, word in enumerate(
        words_in_order(
            "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
            " seventeen eighteen nineteen twenty"
        )
    )
} | {"thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90, "dozen": 12}
MULTIPLIERS = {
    "hundred": 100,
    "thousand": 1000,
    "k": 1000,
    "million": 10**6,
    "m": 10**6,
    "bn": 10**9,
    "billion": 10**9,
}

CURRENCY_SYMBOLS = {"£": "gbp", "$": "usd", "€": "eur", "¥": "jpy", "₹": "inr"}
CURRENCY_WORDS = {
    "dollar": "usd", "dollars": "usd", "usd": "usd", "buck": "usd", "bucks": "usd",
    "euro": "eur", "euros": "eur", "eur": "eur", "pound": "gbp", "pounds": "gbp", "gbp": "gbp",
    "sterling": "gbp", "quid": "gbp", "yen": "jpy", "jpy": "jpy", "rupee": "inr", "rupees": "inr",
    "inr": "inr", "yuan": "cny", "cny": "cny", "franc": "chf", "francs": "chf", "chf": "chf",
    "cent": "cent", "cents": "cent", "pence": "pence", "penny": "pence", "bitcoin": "btc", "btc": "btc",
    "ethereum": "eth", "eth": "eth", "cad": "cad", "aud": "aud",
}  # fmt: skip
# Units anywhere in the text.
UNITS = {
    "km": "km", "kms": "km", "kilometre": "km", "kilometres": "km", "kilometer": "km", "kilometers": "km",
    "mile": "mile", "miles": "mile", "metre": "m", "metres": "m", "meter": "m", "meters": "m",
    "cm": "cm", "centimetre": "cm", "centimetres": "cm", "centimeter": "cm", "centimeters": "cm",
    "mm": "mm", "millimetre": "mm", "millimetres": "mm", "inch": "inch", "inches": "inch",
    "ft": "ft", "feet": "ft", "yard": "yd", "yards": "yd", "kg": "kg", "kgs": "kg", "kilo": "kg",
    "kilos": "kg", "kilogram": "kg", "kilograms": "kg", "gram": "g", "grams": "g", "gramme": "g",
    "grammes": "g", "mg": "mg", "milligram": "mg", "milligrams": "mg", "lb": "lb", "lbs": "lb",
    "oz": "oz", "ounce": "oz", "ounces": "oz", "tonne": "tonne", "tonnes": "tonne", "litre": "l",
    "litres": "l", "liter": "l", "liters": "l", "ml": "ml", "millilitre": "ml", "millilitres": "ml",
    "cl": "cl", "gallon": "gal", "gallons": "gal", "pint": "pint", "pints": "pint", "quart": "quart",
    "quarts": "quart", "tablespoon": "tbsp", "tablespoons": "tbsp", "tbsp": "tbsp", "teaspoon": "tsp",
    "teaspoons": "tsp", "tsp": "tsp", "celsius": "°c", "centigrade": "°c", "°c": "°c",
    "fahrenheit": "°f", "°f": "°f", "kelvin": "kelvin", "mph": "mph", "kph": "km/h", "kmh": "km/h",
    "km/h": "km/h", "knot": "knot", "knots": "knot", "mach": "mach", "kb": "kb", "mb": "mb", "gb": "gb",
    "tb": "tb", "kilobyte": "kb", "kilobytes": "kb", "megabyte": "mb", "megabytes": "mb",
    "gigabyte": "gb", "gigabytes": "gb", "terabyte": "tb", "terabytes": "tb", "kbps": "kbps",
    "mbps": "mbps", "gbps": "gbps", "watt": "w", "watts": "w", "kw": "kw", "kilowatt": "kw",
    "kilowatts": "kw", "kwh": "kwh", "mah": "mah", "volt": "v", "volts": "v", "amp": "amp", "amps": "amp",
    "acre": "acre", "acres": "acre", "hectare": "ha", "hectares": "ha", "cc": "cc", "kcal": "kcal",
    "calorie": "kcal", "calories": "kcal",
}  # fmt: skip
# Units only right after a number: elsewhere these are ordinary words ("World Cup", "my foot").
UNITS_AFTER_NUMBER = {
    "m": "m", "g": "g", "l": "l", "w": "w", "v": "v", "h": "hour", "p": "p", "t": "tonne", "c": "°c",
    "f": "°f", "cup": "cup", "cups": "cup", "foot": "ft", "stone": "stone", "ton": "ton", "tons": "ton",
    "degree": "degree", "degrees": "degree", "square": "square", "barrel": "barrel", "barrels": "barrel",
    "second": "second", "seconds": "second", "sec": "second", "secs": "second", "minute": "minute",
    "minutes": "minute", "min": "minute", "mins": "minute", "hour": "hour", "hours": "hour", "hr": "hour",
    "hrs": "hour", "day": "day", "days": "day", "week": "week", "weeks": "week", "month": "month",
    "months": "month", "year": "year", "years": "year", "yr": "year", "yrs": "year", "x": "times",
    "times": "times", "page": "page", "pages": "page", "person": "person", "people": "person",
}  # fmt: skip
ORDINAL_SUFFIXES = words("st nd rd th")
