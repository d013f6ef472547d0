"""Word pools and sentence templates for the benchmark workloads, kept in the repo so runs
are reproducible offline.

A template field `{x}` (or `{x2}`, `{x3}` for a second, third pick) is filled from `POOLS["x"]`
unless the caller supplies its own choices for that name (e.g. `first`, `other`, `subject`).
"""

from __future__ import annotations

FIRST_NAMES = (
    "Abigail", "Adam", "Aisha", "Alejandro", "Amara", "Anders", "Arthur", "Astrid", "Beatrice",
    "Benjamin", "Carlos", "Carmen", "Chen", "Chloe", "Dalia", "Daniel", "Dmitri", "Eleanor",
    "Elif", "Emeka", "Esther", "Fatima", "Felix", "Fiona", "Gabriel", "Grace", "Hamid", "Hannah",
    "Hiro", "Ingrid", "Isaac", "Isabella", "Jamal", "Jasmine", "Javier", "Johanna", "Jonas",
    "Kavya", "Kenji", "Klaus", "Laila", "Leon", "Lucia", "Mabel", "Malik", "Margaret", "Marta",
    "Mateo", "Mei", "Miguel", "Mira", "Nadia", "Nathan", "Nia", "Noah", "Olga", "Omar", "Oscar",
    "Priya", "Quentin", "Rafael", "Rania", "Rosa", "Ruth", "Samuel", "Sana", "Sebastian",
    "Sofia", "Stefan", "Tamar", "Theo", "Tomas", "Uma", "Valentina", "Victor", "Wendy",
    "Xavier", "Yara", "Yusuf", "Zara",
)

LAST_NAMES = (
    "Abbott", "Alvarez", "Bauer", "Bianchi", "Brennan", "Castillo", "Chowdhury", "Dubois",
    "Eriksen", "Fischer", "Fontaine", "Garcia", "Haddad", "Hartley", "Ivanova", "Jensen",
    "Kaur", "Kowalski", "Lambert", "Lindqvist", "Moreau", "Murphy", "Nakamura", "Novak",
    "Okafor", "Olsen", "Patel", "Petrov", "Quinn", "Ramirez", "Rossi", "Sato", "Schmidt",
    "Silva", "Sullivan", "Tanaka", "Torres", "Underwood", "Vargas", "Wagner", "Whitfield",
    "Yamamoto", "Zhang", "Zielinski",
)

TOWNSFOLK = ("the mayor", "the postman", "old Mrs. Hale", "the new pharmacist", "the ferry captain")

POOLS: dict[str, tuple[str, ...]] = {
    "occupation": (
        "baker", "pharmacist", "schoolteacher", "carpenter", "librarian", "nurse", "painter",
        "bookshop owner", "mechanic", "florist", "barista", "retired sailor", "veterinarian",
        "journalist", "electrician", "beekeeper", "postal worker", "architect", "music teacher",
        "grocer", "bus driver", "tailor", "software developer", "farmer", "potter",
        "pastry chef", "accountant", "fisherman", "park ranger", "dentist", "plumber",
        "photographer", "social worker", "locksmith", "translator", "bicycle repairer",
        "innkeeper", "chemistry student", "town clerk", "gardener",
    ),
    "trait": (
        "curious", "stubborn", "generous", "shy", "talkative", "meticulous", "impatient",
        "warm-hearted", "sarcastic", "optimistic", "anxious", "ambitious", "easygoing",
        "skeptical", "thoughtful", "competitive", "forgetful", "loyal", "blunt", "patient",
        "playful", "reserved", "restless", "practical", "sentimental", "witty", "cautious",
        "idealistic", "frugal", "adventurous", "diplomatic", "moody", "cheerful", "earnest",
        "proud", "gentle", "nosy", "disciplined", "dreamy", "outspoken",
    ),
    "home": (
        "in a small flat above the bakery", "in a blue cottage near the river",
        "on a farm at the edge of town", "in a narrow house on Willow Lane",
        "in a converted lighthouse", "with two roommates near the college",
        "in the apartments behind the cafe", "in a cabin by the pine woods",
        "in the old stone house on Hill Street", "on a houseboat moored at the docks",
        "above the hardware store", "in a townhouse facing the park",
        "with an elderly parent on Maple Avenue", "in a rented room at the inn",
        "in a bungalow full of houseplants", "next door to the fire station",
    ),
    "value": (
        "keeping the community close", "honest work", "a quiet life", "learning new things",
        "fairness", "the local environment", "family", "good food shared with friends",
        "independence", "making art", "helping neighbours", "saving money",
        "the town's history", "the children of the town", "staying healthy",
    ),
    "place": (
        "library", "market square", "town hall", "cafe", "bakery", "community garden",
        "riverside park", "pharmacy", "old mill", "train station", "school gym",
        "harbour", "bookshop", "pub", "post office", "church hall", "hardware store",
        "farmers' market", "clinic", "bus depot", "museum", "swimming pool", "fire station",
        "college campus", "bridge", "playground", "dance studio", "flower shop",
    ),
    "activity": (
        "repaired a wobbly fence", "baked bread for the neighbours", "read the local newspaper",
        "helped a child find a lost cat", "painted a mural", "argued about parking",
        "planted tomatoes", "fixed a leaking tap", "sorted donated books",
        "practised the violin", "organised a chess tournament", "walked the dog",
        "delivered groceries to an elderly couple", "sketched the river", "cleaned the windows",
        "wrote a letter to the council", "tasted the new seasonal pastry",
        "listened to a debate about the budget", "swept up broken glass",
        "taught a short workshop on composting", "tuned an old piano",
        "hung posters for the festival", "collected signatures for a petition",
        "shared a pot of soup", "photographed the sunrise", "mended a torn sail",
    ),
    "plan": (
        "organise a cleanup of the riverbank", "throw a surprise birthday party",
        "open a small reading club", "run for the town council",
        "start a vegetable stall at the market", "repaint the community centre",
        "ask the council for a new bus stop", "set up a tool-lending library",
        "host a potluck dinner", "teach evening classes", "fix the broken streetlights",
        "raise money for the animal shelter", "record an oral history of the town",
        "build a bench by the harbour", "launch a neighbourhood newsletter",
        "plan a hiking trip to the ridge", "collect coats for the winter drive",
    ),
    "topic": (
        "the upcoming town election", "the rising price of bread", "the festival next weekend",
        "the new bike lanes", "the flooding near the old mill", "rumours about a new factory",
        "the school's music programme", "the broken clock on the town hall",
        "the closing of the post office", "the summer drought", "a mysterious stranger at the inn",
        "the plan to renovate the library", "noise from the harbour at night",
        "the farmers' market moving indoors", "the wedding at the church hall",
        "whether the bridge is safe", "the shortage of nurses at the clinic",
        "the proposal for a skate park", "stray dogs in the park", "the autumn harvest",
    ),
    "item": (
        "a jar of honey", "fresh strawberries", "an old map", "a second-hand bicycle",
        "a basket of apples", "a loaf of rye bread", "a pair of gardening gloves",
        "a box of candles", "a secondhand novel", "a bag of coffee beans", "a wool scarf",
        "a bunch of tulips", "a tin of biscuits", "a birdhouse", "a toolbox",
    ),
    "time": (
        "seven in the morning", "half past eight", "noon", "two in the afternoon",
        "four o'clock", "sunset", "six in the evening", "nine at night",
    ),
    "weekday": ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"),
    "feeling": (
        "hopeful", "uneasy", "excited", "frustrated", "proud", "worried", "amused",
        "grateful", "confused", "determined", "nostalgic", "annoyed",
    ),
    "district": (
        "Harbourside", "Northgate", "Riverbend", "Old Town", "Eastfield", "Millbrook",
        "Southport", "Cedar Heights", "Westmarket", "Lakeshore", "Station Quarter",
        "Greenhill", "Foundry Row", "Palm Terrace", "University Park",
    ),
    "econ_action": (
        "bought groceries for the week at the discount market", "paid the electricity bill",
        "worked an extra shift at the warehouse", "put some money into a savings account",
        "skipped eating out to save money", "filled up the car with gasoline",
        "lent money to a cousin", "signed up for an evening training course",
        "cancelled a streaming subscription", "sold an old sofa online",
        "visited the doctor about a persistent cough", "took the bus instead of driving",
        "paid the monthly rent", "bought school supplies for the children",
        "applied for a job at the logistics centre", "repaired the roof after a storm",
        "stocked up on rice and canned food", "donated to the neighbourhood food bank",
        "went to a job fair downtown", "negotiated a smaller rent increase",
        "bought a used washing machine", "volunteered at the community kitchen",
    ),
    "good": (
        "bread", "rice", "gasoline", "electricity", "bus fares", "milk", "cooking oil",
        "rent", "medicine", "coffee", "eggs", "bottled water", "internet service",
    ),
    "percent": ("3", "5", "8", "10", "12", "15", "20", "25", "30", "40"),
    "hours": ("12", "24", "36", "48", "72"),
    "group": (
        "small businesses", "commuters", "students", "pensioners", "low-income families",
        "farmers", "local workers", "parents", "renters", "young people", "taxpayers",
    ),
    "org": (
        "National Statistics Office", "University of Eastbrook", "Institute for Public Policy",
        "Civic Research Council", "World Health Organization", "Chamber of Commerce",
        "Federation of Trade Unions", "Centre for Urban Studies", "OECD",
    ),
    "city": (
        "Amsterdam", "Copenhagen", "Melbourne", "Toronto", "Seoul", "Lisbon", "Bogota",
        "Nairobi", "Vienna", "Singapore", "Helsinki", "Montreal",
    ),
    "year": ("2015", "2017", "2018", "2019", "2020", "2021", "2022", "2023"),
}

# --- generative_agents -----------------------------------------------------------------------

PERSONA = ("{first} {last} is a {age}-year-old {occupation} who lives {home}. {first} is {trait} "
           "and {trait2}, and cares most about {value}.")

MEMORY_TEMPLATES = (
    "{first} {activity} at the {place} on {weekday}.",
    "{first} talked with {other} about {topic} at the {place}.",
    "{first} feels {feeling} about {topic}.",
    "{first} plans to {plan} before {weekday}.",
    "{first} noticed that the {place} was unusually crowded around {time}.",
    "Last week {other} asked {first} for help to {plan}.",
    "{first} bought {item} at the {place} and shared some with {other}.",
    "On {weekday} {first} and {other} {activity} together.",
    "{first} overheard {other2} complaining about {topic}.",
    "{first} promised {other} to meet at the {place} at {time}.",
    "When {first} was young, the {place} was the heart of the town.",
    "{first} still remembers the day {other} {activity}.",
)

STATEMENT_TEMPLATES = (
    "I {activity} at the {place} this morning, and it got me thinking about {topic}.",
    "Honestly, I feel {feeling} about {topic}.",
    "I want to {plan}, and I could use a few volunteers.",
    "If anyone wants to join me, I will be at the {place} around {time}.",
    "Has anyone else heard the news about {topic}?",
    "I ran into {other} at the {place} yesterday and we talked for an hour.",
    "My plan for {weekday} is simple: I want to {plan}.",
    "I think the {place} needs more attention than the {place2} right now.",
    "Someone left {item} outside the {place}, and I am keeping it safe until they come back.",
    "We should all talk about {topic} before the next town meeting.",
)

# --- agentsociety ----------------------------------------------------------------------------

PROFILE = ("Resident profile: {first} {last}, age {age}, {occupation}, living in the {district} "
           "district in a household of {household}. {first} is {trait} and {trait2}.")

ECONOMY = ("Economic situation: monthly income about ${income}, savings of ${savings}, and rent "
           "of ${rent}. {first} is {feeling} about money this month.")

PAST_ACTION_TEMPLATES = (
    "{first} {econ_action}.",
    "{first} {econ_action} and then {econ_action2}.",
    "{first} noticed that {good} now costs {percent} percent more than last month.",
    "{first} talked with {other} about whether to {plan}.",
    "{first} spent the evening at the {place} in {district}.",
    "{first} felt {feeling} after reading the news about {good} prices.",
)

POST_TEMPLATES = (
    "Today I {econ_action}.",
    "Prices for {good} went up again, about {percent} percent since last month.",
    "I am trying to save money, so I {econ_action}.",
    "Does anyone in {district} know a cheaper place to buy {good}?",
    "I feel {feeling} about my budget this week.",
    "My neighbour {other} and I decided to share rides to save on {good}.",
    "I heard the {place} in {district} is hiring for the season.",
    "Next week I plan to {plan}.",
)

# An event's sentences: the first is its headline, the rest describe it.
EVENTS = (
    ("The weather service has issued a hurricane warning: landfall is expected within {hours} "
     "hours.",
     "Residents of the {district} district are advised to prepare to evacuate.",
     "Shops report long queues for bottled water, batteries and canned food.",
     "Schools and the {place} will close until the storm has passed.",
     "Emergency shelters are opening at the school gym and the church hall."),
    ("The price of {good} rises by {percent} percent starting next Monday.",
     "Officials blame higher import costs and a weak currency.",
     "Consumer groups warn that {group} will be hit hardest.",
     "Several stores in {district} announced temporary discounts to keep customers."),
    ("The central bank raised its interest rate by half a percentage point.",
     "Mortgage payments for many households will increase next month.",
     "Economists expect savings accounts to pay slightly more interest.",
     "Local businesses say loans for new equipment are getting harder to afford."),
    ("A new logistics centre in {district} will hire {percent}0 workers this month.",
     "Applications open on {weekday} at the {place}.",
     "The jobs pay above the minimum wage and include evening shifts.",
     "Union representatives ask for clear rules about overtime."),
    ("Public transport workers announced a {hours}-hour strike.",
     "Buses and trains will not run during the strike.",
     "The city recommends car sharing and cycling where possible.",
     "Taxi companies expect very high demand and longer waiting times."),
    ("The government will send a one-time tax rebate to every household next month.",
     "The rebate is larger for families with children and for pensioners.",
     "Critics say the money will mostly be spent on imported goods.",
     "Banks warn residents about scam messages pretending to be the tax office."),
    ("A heat wave is expected to last at least five days.",
     "Electricity demand may exceed supply during the afternoon peak.",
     "The city asks residents to limit the use of air conditioning between two and six.",
     "Cooling rooms are open at the {place} and the library."),
    ("A large factory in {district} announced it will close at the end of the year.",
     "About {percent}00 workers will lose their jobs.",
     "The council promises retraining programmes and temporary support.",
     "Shop owners nearby fear that their sales will fall."),
)

NEWS_FOLLOWUPS = (
    "Residents of {district} say they are {feeling} about what comes next.",
    "The council will hold a public meeting at the {place} on {weekday}.",
    "Analysts at the {org} expect the effect on {good} prices to last several weeks.",
    "Community volunteers are coordinating help for {group}.",
    "More updates will follow in the evening broadcast.",
)

# --- debate ----------------------------------------------------------------------------------

# (motion, subject): the subject is a noun phrase the background and arguments talk about.
MOTIONS = (
    ("This house would ban private cars from city centres", "private cars in city centres"),
    ("This house believes that homework should be abolished", "homework in primary schools"),
    ("This house would introduce a universal basic income", "a universal basic income"),
    ("This house would make voting compulsory", "compulsory voting"),
    ("This house believes social media does more harm than good", "social media"),
    ("This house would tax sugary drinks", "a tax on sugary drinks"),
    ("This house would adopt a four-day working week", "a four-day working week"),
    ("This house would replace exams with continuous assessment", "final exams"),
)

DEBATER = ("{first} {last} ({occupation}) speaks {side} the motion in this debate. Style: {trait} "
           "and {trait2}.")

DEBATE_RULES = ("Motion: {motion}.\nFormat: speakers alternate between the proposition and the "
                "opposition; every speaker must answer the strongest argument made so far and may "
                "add at most one new argument. The judge rewards evidence, clarity and direct "
                "engagement.")

BACKGROUND_TEMPLATES = (
    "A {year} study by the {org} found that {subject} affected about {percent} percent of "
    "{group}.",
    "In {city}, the debate about {subject} began after a series of public protests.",
    "Supporters argue that {subject} changes everyday decisions made by {group}.",
    "Critics point out that the evidence on {subject} from {city} is mixed.",
    "According to the {org}, public opinion on {subject} has shifted by {percent} points since "
    "{year}.",
    "A pilot programme in {city} reported lower costs for {group} but higher costs for "
    "{group2}.",
    "Researchers at the {org} warn that short trials may overstate the benefits of {subject}.",
    "Surveys show that {group} care more about fairness than about cost.",
    "Local governments in {city} and {city2} took opposite approaches to {subject}.",
    "Historical data from {year} suggests that change was slow at first and then accelerated.",
)

OPENING = "I rise to speak {side} the motion on {subject}."

ARGUMENT_TEMPLATES = (
    "The evidence from {city} shows that {group} are the ones who pay the price.",
    "My opponents ignore what the {org} found in {year}.",
    "We must ask who benefits: {group} or {group2}?",
    "Fairness demands that we take {subject} seriously.",
    "A policy is only as good as its enforcement, and enforcement is where this debate turns.",
    "Think of the {group} in {city} who lived through exactly this change.",
    "The burden of proof lies with those who want to change the status quo.",
)
