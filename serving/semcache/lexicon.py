"""The word lists the semantic cache's verifier reads (serving.semcache.verify).

Lower case; a word may sit in several lists. Stems in ``PERIOD_KEYS`` are as
``verify._stem`` writes them.
"""

from __future__ import annotations


def words(text: str) -> frozenset[str]:
    return frozenset(text.split())


def words_in_order(text: str) -> list[str]:
    return text.split()


STOPWORDS = words(
    """
    a an the this that these those there here it its i me my mine myself you your yours yourself ur u
    we our ours us they them their theirs he him his she her hers someone somebody anyone anybody
    everyone something anything everything thing things is am are was were be been being do does did
    doing done have has had having will would shall should can could may might must ought what whats
    which who whom whose when where why how whether if then than so and or but as at by for from in into
    of on onto to with about via per out up down off over under also just really actually exactly
    basically properly usually generally normally typically kindly please pls plz hey hi hello dear
    thanks thank thx cheers ok okay quick question wondering wonder know tell explain let lets like
    want wanted wants wish some any many much few lot lots such very too quite rather again still yet
    get gets got getting make makes made making go goes going went way ways method process steps step
    procedure possible able other another else same sure well anyway now currently there's somehow
    mean means meant info information details detail help guide advice tips answer through across around
    along among between within during until since upon against toward towards behind near fully
    completely totally entirely absolutely definitely simply even ever people using
    """
)
PRONOUNS = {
    "i": "me",
    "me": "me",
    "you": "you",
    "he": "him",
    "him": "him",
    "we": "us",
    "us": "us",
    "they": "them",
    "them": "them",
}
DETERMINERS = words("a an the my your our their his her its this that these those some any ur")
QUESTION_WORDS = words("who whom whose when where why")
NEGATIONS = words("not no never without none nothing nobody nowhere neither nor non")
# Role markers: a content word's role is the marker in front of it (determiners may sit between).
MARKERS = {
    "from": "from", "to": "to", "into": "to", "onto": "to", "towards": "to", "toward": "to",
    "than": "than", "instead": "than", "vs": "vs", "versus": "vs", "v": "vs", "before": "before",
    "after": "after", "with": "with", "using": "with", "by": "by", "of": "of", "in": "in", "on": "on", "at": "at",
}  # fmt: skip

# Opposite poles: a prompt with words of only one pole against one with words of only another.
SCOPE_GROUPS: tuple[tuple[frozenset[str], ...], ...] = tuple(
    tuple(words(pole) for pole in group.split("|"))
    for group in (
        "over above exceed exceeding exceeds beyond greater | under below beneath",
        "more | less fewer",
        "most | least",
        "before prior earlier | after afterwards later",
        "first earliest initial | last latest final newest",
        "min minimum minimal minimise minimize | max maximum maximal maximise maximize",
        "buy buying bought purchase | sell selling sold",
        "import importing imported | export exporting exported",
        "increase increasing raise rise boost | decrease decreasing reduce lower",
        "up | down",
        "in | out",
        "on | off",
        "open opening | close closing shut",
        "start starting begin beginning commence | stop stopping end ending finish",
        "enable enabled activate | disable disabled deactivate",
        "add adding | remove removing delete deleting",
        "include includes including included inclusive | exclude excludes excluding excluded except",
        "push | pull",
        "upload uploading | download downloading",
        "send sending sent | receive receiving received",
        "lend lending lent | borrow borrowing borrowed",
        "deposit depositing | withdraw withdrawing withdrawal",
        "win winning won winner | lose losing lost loser",
        "gain gaining | lose losing",
        "early earlier earliest | late later latest",
        "high higher highest tall taller tallest | low lower lowest short shorter shortest",
        "big bigger biggest large larger largest | small smaller smallest tiny",
        "long longer longest | short shorter shortest",
        "old older oldest | young younger youngest",
        "new | existing old",
        "hot hotter hottest warm warmer warmest heat | cold colder coldest cool cooler coolest",
        "heavy heavier heaviest | light lighter lightest",
        "fast faster fastest quick quicker quickest | slow slower slowest",
        "cheap cheaper cheapest inexpensive | expensive pricey",
        "good better best | bad worse worst",
        "pro pros advantage advantages | con cons disadvantage disadvantages drawback drawbacks downside",
        "left | right",
        "north northern | south southern",
        "east eastern | west western",
        "inbound incoming arrival arrivals arrive arriving | outbound outgoing departure departures depart departing",
        "hire hiring | fire firing dismiss sack",
        "empty | full",
        "all every entire whole | some partial",
        "always | sometimes occasionally rarely",
        "inside indoor indoors interior | outside outdoor outdoors exterior",
        "plus | minus",
        "positive | negative",
        "adult adults | child children kid kids",
        "domestic | international abroad overseas foreign",
        "encrypt encrypted encryption | decrypt decrypted decryption",
        "accept accepted allow allowed permit permitted approve approved"
        " | reject rejected deny denied ban banned forbid forbidden prohibit prohibited refuse refused"
        " decline declined",
        "true | false",
        "male men man boy boys | female women woman girl girls",
        "upgrade | downgrade",
        "upstairs | downstairs",
        "forward forwards | backward backwards",
        "internal | external",
        "public | private",
        "mandatory compulsory obligatory | optional voluntary",
        "upper | lower",
        "top | bottom",
        "front | rear",
        "hourly | daily | weekly | monthly | annual annually yearly",
        "sunrise dawn | sunset dusk",
        "raw | cooked",
        "wet | dry",
        "easy easier easiest simple | hard harder hardest difficult",
        "safe safer safest | dangerous risky",
        "loud louder | quiet quieter",
        "near nearer nearest close closer closest | far farther farthest further furthest distant",
        "wide wider widest | narrow narrower narrowest",
        "thick thicker | thin thinner",
        "deep deeper deepest | shallow shallower",
        "strong stronger strongest | weak weaker weakest",
        "rich richer richest | poor poorer poorest",
        "inner | outer",
        "vertical vertically | horizontal horizontally",
    )
)
SCOPE_WORDS = frozenset(w for group in SCOPE_GROUPS for pole in group for w in pole)
# A comparison in front of a number or amount limits it: "under £50" is not "£50".
COMPARATIVES = {
    "over": "over", "above": "over", "exceeding": "over", "under": "under", "below": "under",
    "more": "over", "less": "under", "fewer": "under", "least": "over", "most": "under",
    "minimum": "over", "min": "over", "maximum": "under", "max": "under", "upto": "under",
}  # fmt: skip
LIMITERS = words("only except excluding exclusively")

# Antonyms by prefix: "unsafe" against "safe" (the rest must be a word of the other prompt).
# (prefix, shortest rest): "in" + "put" is no antonym, "in" + "valid" is.
NEGATING_PREFIXES = (
    ("non", 3), ("dis", 4), ("un", 3), ("in", 4), ("im", 4), ("il", 4), ("ir", 4), ("ab", 5), ("de", 5),
)  # fmt: skip
SCOPE_PREFIXES = (("over", "under"), ("under", "over"), ("up", "down"), ("down", "up"))

SYNONYMS = {
    canonical: words(group)
    for canonical, group in (
        line.split(":")
        for line in """
        buy: purchase
        cost: price prices pricing priced charge charges fee fees
        fix: repair mend resolve troubleshoot
        start: begin commence
        car: automobile vehicle
        phone: mobile cellphone smartphone handset
        movie: film
        doctor: physician gp
        child: kid kids children
        big: large huge
        small: little tiny
        fast: quick quickly rapid rapidly speedy faster quicker
        delete: erase remove rid eliminate
        change: modify alter update edit amend correct
        show: display
        use: utilize utilise
        need: require required requirement necessary
        help: assist assistance
        problem: error issue fault bug
        broken: faulty defective
        store: shop
        booking: reservation
        book: reserve
        luggage: baggage bags bag suitcase
        delivery: shipping postage
        deliver: ship dispatch
        parcel: package
        refund: reimbursement
        fridge: refrigerator
        lawyer: solicitor attorney
        apartment: flat
        holiday: vacation
        trip: journey
        football: soccer
        trash: rubbish garbage
        wifi: wireless wi-fi
        internet: broadband
        computer: pc
        email: e-mail emails
        password: passcode
        photo: picture pic image
        tv: television
        usa: america american united states
        uk: britain british
        integer: int
        dictionary: dict
        javascript: js
        directory: folder
        cancel: terminate
        job: employment
        salary: wage wages income
        leave: time-off
        dog: puppy doggy
        cat: kitten
        cook: cooking
        medicine: medication medicines medications drug drugs
        stomach: tummy
        sick: ill unwell
        symptom: sign signs
        """.strip().splitlines()
    )
    for canonical in [canonical.strip()]
}

MONTHS = {
    name: number
    for number, names in enumerate(
        ("january jan", "february feb", "march mar", "april apr", "may", "june jun", "july jul", "august aug",
         "september sep sept", "october oct", "november nov", "december dec"),
        start=1,
    )
    for name in names.split()
}  # fmt: skip
WEEKDAYS = words("monday tuesday wednesday thursday friday saturday sunday weekday weekdays weekend weekends")
DAY_WORDS = words("today tomorrow yesterday tonight")
TIMES_OF_DAY = words("morning mornings afternoon afternoons evening evenings night nights noon midday midnight")
SEASONS = words("spring summer autumn winter")
HOLIDAYS = words(
    "christmas xmas easter halloween thanksgiving ramadan diwali hanukkah eid passover valentine valentines eve"
)
RELATIVE = words("this next last coming previous")
PERIODS = words("week weekend month year season quarter morning afternoon evening night")

NUMBER_WORDS = {
    word: number
    for number, word in enumerate(
        words_in_order(
            "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
            " seventeen eighteen nineteen twenty"
        )
    )
} | {"thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90, "dozen": 12}
ORDINAL_WORDS = {
    "third": 3, "fourth": 4, "fifth": 5, "sixth": 6, "seventh": 7, "eighth": 8, "ninth": 9, "tenth": 10,
    "eleventh": 11, "twelfth": 12, "half": 0.5, "quarter": 0.25,
}  # fmt: skip
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
PERIOD_KEYS = words("second minut hour day week fortnight month year decad century")  # as stemmed

PLACES = words(
    """
    afghanistan albania algeria argentina armenia australia austria azerbaijan bahrain bangladesh belarus
    belgium bolivia bosnia brazil bulgaria cambodia cameroon canada chile china colombia croatia cuba
    cyprus czechia denmark ecuador egypt estonia ethiopia finland france georgia germany ghana greece
    guatemala haiti honduras hungary iceland india indonesia iran iraq ireland israel italy jamaica japan
    jordan kazakhstan kenya korea kuwait laos latvia lebanon libya lithuania luxembourg madagascar malaysia
    mali malta mexico moldova monaco mongolia morocco mozambique myanmar nepal netherlands zealand nigeria
    norway oman pakistan panama paraguay peru philippines poland portugal qatar romania russia rwanda
    scotland senegal serbia singapore slovakia slovenia somalia spain sudan sweden switzerland syria taiwan
    tanzania thailand tunisia turkey uganda ukraine uruguay uzbekistan venezuela vietnam wales yemen zambia
    zimbabwe england europe africa asia london paris berlin madrid rome lisbon dublin amsterdam brussels
    vienna prague warsaw budapest athens oslo stockholm copenhagen helsinki moscow istanbul dubai tokyo
    osaka kyoto seoul beijing shanghai delhi mumbai bangkok sydney melbourne toronto vancouver montreal
    chicago boston miami seattle austin dallas houston denver york jersey manchester leeds glasgow
    edinburgh bristol liverpool cardiff belfast english french german spanish italian portuguese dutch
    russian chinese japanese korean arabic hindi greek turkish polish swedish python java javascript
    kotlin swift rust ruby perl scala haskell
    """
)
