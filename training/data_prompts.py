"""Deterministic, template-based builder of diverse chat training prompts, deduplicated against the eval sets."""

from __future__ import annotations

import argparse
import json
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
EVAL_FILES: tuple[Path, ...] = (
    REPO_ROOT / "bench" / "data" / "eval_short.jsonl",
    REPO_ROOT / "bench" / "data" / "long_answer.jsonl",
    REPO_ROOT / "bench" / "data" / "long_checkable.jsonl",
)
DEFAULT_OUT = REPO_ROOT / "training" / "data" / "prompts.jsonl"
_POOL_SEED = 1234  # fixed: the candidate pool never depends on the sampling seed

# --------------------------------------------------------------------------------------
# Vocabularies (hand-written). Entities used by the short eval set are deliberately left
# out of the short-answer templates (e.g. no capital-city question about France or Japan).
# --------------------------------------------------------------------------------------

COUNTRIES = [
    "Peru", "Chile", "Kenya", "Nigeria", "Vietnam", "Thailand", "Sweden", "Finland", "Poland",
    "Hungary", "Turkey", "Morocco", "Argentina", "Colombia", "Mexico", "India", "Indonesia",
    "Australia", "New Zealand", "South Korea", "the Philippines", "Pakistan", "Ethiopia", "Ghana",
    "Senegal", "Cuba", "Jamaica", "Iceland", "Denmark", "the Netherlands", "Belgium", "Switzerland",
    "Romania", "Bulgaria", "Croatia", "Ukraine", "Saudi Arabia", "Jordan", "Nepal", "Bangladesh",
    "Sri Lanka", "Malaysia", "Singapore", "Mongolia", "Kazakhstan", "Tanzania", "Uganda",
    "South Africa", "Bolivia", "Ecuador", "Uruguay", "Tunisia", "Estonia", "Latvia", "Lithuania",
    "Slovakia", "Slovenia", "Cambodia", "Laos", "Madagascar", "Rwanda", "Costa Rica", "Panama",
    "Guatemala", "Fiji", "Paraguay", "Venezuela", "Bhutan", "Oman", "Qatar",
]

CITIES = [
    "New York", "Sydney", "Rio de Janeiro", "Istanbul", "Mumbai", "Toronto", "Chicago", "Cape Town",
    "Buenos Aires", "Amsterdam", "Prague", "Seoul", "Bangkok", "Dubai", "Marrakech", "Nairobi", "Lima",
    "Mexico City", "San Francisco", "Stockholm", "Copenhagen", "Vancouver", "Melbourne", "Havana",
    "Krakow", "Budapest", "Hanoi", "Delhi", "Montreal", "Zurich", "Casablanca", "Cusco", "Auckland",
    "Quebec City", "Boston", "Cartagena", "Valparaiso", "Chiang Mai", "Zanzibar City", "Reykjavik",
]

# (singular, plural)
ANIMALS = [
    ("octopus", "octopuses"), ("kangaroo", "kangaroos"), ("koala", "koalas"), ("panda", "pandas"),
    ("polar bear", "polar bears"), ("camel", "camels"), ("hedgehog", "hedgehogs"), ("otter", "otters"),
    ("beaver", "beavers"), ("squirrel", "squirrels"), ("parrot", "parrots"), ("flamingo", "flamingos"),
    ("hummingbird", "hummingbirds"), ("ostrich", "ostriches"), ("peacock", "peacocks"),
    ("sea turtle", "sea turtles"), ("jellyfish", "jellyfish"), ("starfish", "starfish"),
    ("seahorse", "seahorses"), ("salmon", "salmon"), ("ant", "ants"), ("ladybug", "ladybugs"),
    ("earthworm", "earthworms"), ("chameleon", "chameleons"), ("gorilla", "gorillas"),
    ("chimpanzee", "chimpanzees"), ("sloth", "sloths"), ("hippopotamus", "hippopotamuses"),
    ("rhinoceros", "rhinoceroses"), ("wolf", "wolves"), ("deer", "deer"), ("moose", "moose"),
    ("raccoon", "raccoons"), ("squid", "squid"), ("lobster", "lobsters"), ("crab", "crabs"),
    ("bison", "bison"), ("llama", "llamas"), ("alpaca", "alpacas"), ("meerkat", "meerkats"),
    ("lemur", "lemurs"), ("hyena", "hyenas"), ("walrus", "walruses"), ("seal", "seals"),
    ("pelican", "pelicans"), ("woodpecker", "woodpeckers"), ("armadillo", "armadillos"),
    ("porcupine", "porcupines"), ("hamster", "hamsters"), ("goldfish", "goldfish"), ("swan", "swans"),
    ("toucan", "toucans"), ("platypus", "platypuses"), ("manatee", "manatees"), ("jaguar", "jaguars"),
    ("leopard", "leopards"), ("skunk", "skunks"), ("mole", "moles"), ("badger", "badgers"),
    ("vulture", "vultures"),
]

# (animal, class) for classification prompts; none of these appear in the short eval set.
ANIMAL_CLASSES = [
    ("kangaroo", "mammal"), ("koala", "mammal"), ("panda", "mammal"), ("camel", "mammal"),
    ("otter", "mammal"), ("gorilla", "mammal"), ("walrus", "mammal"), ("hamster", "mammal"),
    ("parrot", "bird"), ("flamingo", "bird"), ("ostrich", "bird"), ("pelican", "bird"),
    ("toucan", "bird"), ("swan", "bird"), ("vulture", "bird"), ("woodpecker", "bird"),
    ("salmon", "fish"), ("goldfish", "fish"), ("tuna", "fish"), ("trout", "fish"), ("cod", "fish"),
    ("chameleon", "reptile"), ("iguana", "reptile"), ("tortoise", "reptile"), ("gecko", "reptile"),
    ("alligator", "reptile"), ("salamander", "amphibian"), ("toad", "amphibian"), ("newt", "amphibian"),
]

PEOPLE = [
    "Albert Einstein", "Marie Curie", "Isaac Newton", "Charles Darwin", "Ada Lovelace",
    "Galileo Galilei", "Nikola Tesla", "Mahatma Gandhi", "Nelson Mandela", "Cleopatra",
    "Julius Caesar", "Napoleon Bonaparte", "Martin Luther King Jr.", "Abraham Lincoln",
    "Wolfgang Amadeus Mozart", "Ludwig van Beethoven", "Frida Kahlo", "Vincent van Gogh",
    "Pablo Picasso", "Jane Austen", "Charles Dickens", "Mark Twain", "Florence Nightingale",
    "Rosa Parks", "Amelia Earhart", "Thomas Edison", "Alexander Graham Bell", "Louis Pasteur",
    "Aristotle", "Plato", "Socrates", "Confucius", "Genghis Khan", "Queen Victoria", "Joan of Arc",
    "Marco Polo", "Alan Turing", "Rachel Carson", "Jane Goodall", "Stephen Hawking",
    "Johann Sebastian Bach", "Archimedes", "Pythagoras", "Gregor Mendel", "Dmitri Mendeleev",
    "Harriet Tubman", "Ibn Battuta", "Hypatia", "Katherine Johnson", "Grace Hopper",
]

EVENTS = [
    "the invention of the printing press", "the Industrial Revolution", "the Renaissance",
    "the fall of the Western Roman Empire", "the Silk Road", "the invention of the telephone",
    "the discovery of penicillin", "the ancient Olympic Games", "the building of the Great Wall of China",
    "the Age of Exploration", "the invention of the airplane", "the history of the internet",
    "the invention of writing", "the Stone Age", "the Bronze Age", "the agricultural revolution",
    "the Black Death", "the Cold War", "the space race", "the abolition of slavery",
    "the women's suffrage movement", "the invention of the steam engine", "the history of the bicycle",
    "the first computers", "the invention of photography", "the history of paper money",
    "the construction of the Panama Canal", "the history of the Olympic marathon",
]

SCIENCE_CONCEPTS = [
    "gravity", "electricity", "magnetism", "evaporation", "condensation", "erosion", "volcanoes",
    "earthquakes", "ocean tides", "the greenhouse effect", "climate change", "inflation",
    "supply and demand", "compound interest", "the immune system", "vaccines", "DNA", "evolution",
    "cells", "atoms", "molecules", "the speed of light", "sound waves", "friction",
    "the conservation of energy", "renewable energy", "solar panels", "wind turbines", "recycling",
    "composting", "the internet", "a computer's processor", "computer memory", "algorithms",
    "machine learning", "encryption", "cloud storage", "binary numbers", "fractions", "percentages",
    "probability", "the Pythagorean theorem", "prime numbers", "negative numbers", "the metric system",
    "time zones", "the phases of the Moon", "black holes", "the life cycle of a star", "the Big Bang",
    "satellites", "rockets", "plate tectonics", "fossils", "the extinction of the dinosaurs",
    "the food chain", "ecosystems", "biodiversity", "pollination", "digestion", "the nervous system",
    "sleep", "muscles", "the skeleton", "blood types", "antibiotics", "germs", "vitamins", "calories",
    "metabolism", "the stock market", "taxes", "how banks work", "credit scores", "budgeting",
    "interest rates", "international trade", "globalization", "the United Nations", "elections",
    "the separation of powers", "human rights", "freedom of speech", "ethics", "logical fallacies",
    "critical thinking", "the scientific method", "a hypothesis", "statistics", "the normal distribution",
    "latitude and longitude", "GPS", "weather forecasting", "clouds", "lightning", "hurricanes",
    "snowflakes", "deserts", "rainforests", "coral reefs", "glaciers", "ocean currents", "air pressure",
    "batteries", "light bulbs", "lasers", "microwave ovens", "refrigerators", "how airplanes fly",
    "buoyancy", "suspension bridges", "concrete", "plastic", "glass making", "paper making", "soap",
    "fermentation", "chocolate making", "coffee roasting", "nuclear energy", "static electricity",
    "radio waves", "the electromagnetic spectrum", "chemical reactions", "acids and bases",
    "the periodic table", "genetics", "bacteria", "viruses", "the circulatory system", "hormones",
    "memory in the human brain", "habits", "motivation", "supply chains", "opportunity cost",
    "the placebo effect", "camouflage in animals", "animal migration", "hibernation",
]

WHY_QUESTIONS = [
    "Why do leaves change color in autumn?", "Why do cats purr?", "Why is the ocean salty?",
    "Why do we sneeze?", "Why do onions make people cry?", "Why does bread go stale?",
    "Why do birds migrate?", "Why do we need sleep?", "Why does metal feel colder than wood?",
    "Why do stars twinkle?", "Why do we yawn?", "Why do people have fingerprints?",
    "Why do soap bubbles pop?", "Why do apples turn brown after being cut?", "Why do we get goosebumps?",
    "Why do some animals hibernate?", "Why do planes leave white trails in the sky?",
    "Why does popcorn pop?", "Why do cats usually land on their feet?", "Why is it hotter near the equator?",
    "Why do our ears pop on an airplane?", "Why do people have different eye colors?",
    "Why does soda fizz?", "Why do mosquitoes bite?", "Why do we dream?", "Why does hair turn gray?",
    "Why do plants need sunlight?", "Why do wounds itch as they heal?", "Why does salt melt ice on roads?",
    "Why do dogs wag their tails?", "Why do fireflies glow?", "Why do we hiccup?",
    "Why do we see lightning before we hear thunder?", "Why do shadows change length during the day?",
    "Why do some people snore?", "Why is recycling important?", "Why do we need to drink water?",
    "Why does the wind blow?", "Why do some trees lose their leaves in winter?", "Why do tomatoes turn red?",
    "Why do mirrors reflect light?", "Why is biodiversity important?", "Why do prices go up over time?",
    "Why do governments collect taxes?", "Why is the Dead Sea so salty?", "Why do camels have humps?",
    "Why do zebras have stripes?", "Why do owls hunt at night?", "Why do bananas turn brown?",
    "Why do we have different blood types?", "Why do our fingers wrinkle in water?",
    "Why is exercise good for mental health?", "Why do boats float?", "Why does the Moon look bigger near the horizon?",
    "Why do some foods spoil faster than others?", "Why do we blush?", "Why do people need vitamins?",
    "Why do volcanoes erupt?", "Why do earthquakes happen?", "Why do we have tides?",
]

# Plural noun phrases for list prompts.
LIST_THINGS = [
    "vegetables", "tropical fruits", "board games", "sports played with a ball", "birds", "insects",
    "flowers", "trees", "things you can find in a kitchen", "hobbies that can be done indoors",
    "jobs that involve working with animals", "ways to save energy at home", "ways to reduce stress",
    "healthy snacks", "breakfast foods", "famous scientists", "inventions that changed the world",
    "programming languages", "shapes", "types of clouds", "types of weather", "things that are round",
    "animals that live in the desert", "animals that live in the Arctic", "farm animals",
    "popular pets", "sea creatures", "famous rivers", "famous mountains", "famous paintings",
    "classic novels", "action verbs", "adjectives that describe a person", "emotions", "school subjects",
    "things to do on a rainy day", "summer activities", "winter sports", "safety rules for swimming",
    "tools a carpenter uses", "parts of a car", "parts of a computer", "parts of a flower",
    "organs in the human body", "spices", "herbs", "types of bread", "cheeses", "desserts",
    "hot drinks", "ways to be kind to others", "good daily habits", "questions to ask a new friend",
    "names for a pet goldfish", "names for a fantasy village", "words that rhyme with light",
    "things that are green", "things that are soft", "things that float", "things that use electricity",
    "musical genres", "dances from around the world", "famous bridges", "famous buildings",
    "cities in Asia", "countries in Africa", "countries in South America", "languages spoken in Asia",
    "types of renewable energy", "ways to reduce waste", "things to pack for a beach day",
    "items for a first aid kit", "reasons to learn a second language", "benefits of reading",
    "benefits of walking every day", "careers in science", "careers in healthcare",
    "mistakes to avoid when learning to cook", "kinds of pasta", "root vegetables", "citrus fruits",
    "nuts and seeds", "sources of protein", "things you can recycle", "outdoor games for children",
    "card games", "video game genres", "famous composers", "famous explorers", "planets and moons",
    "constellations", "types of rocks", "gemstones", "metals", "chemical elements",
    "parts of a plant", "bones in the human body", "ways to stay warm in winter",
    "ways to keep cool in summer", "things that make people laugh", "polite phrases in English",
    "words that start with the letter B", "words that end in -ing", "types of boats",
    "means of transportation", "things found in a classroom", "things found in a garden",
]

# Infinitive phrases for how-to prompts.
HOWTO_TASKS = [
    "tie a tie", "make a paper airplane", "change a light bulb", "write a good resume",
    "prepare for a job interview", "learn a new language", "start running", "save money each month",
    "make a monthly budget", "clean a laptop keyboard", "take care of a houseplant", "grow tomatoes",
    "set up a fish tank", "train a puppy to sit", "wash a wool sweater", "fold a fitted sheet",
    "make new friends in a new city", "write a thank-you note", "give a good presentation",
    "stop procrastinating", "improve my handwriting", "memorize a speech", "organize my closet",
    "pack a suitcase efficiently", "plan a birthday party", "make cold brew coffee",
    "sharpen a kitchen knife", "remove a coffee stain from a shirt", "back up my phone",
    "create a strong password", "start a vegetable garden", "compost kitchen scraps",
    "reduce plastic waste at home", "fall asleep faster", "start meditating", "stretch after exercise",
    "learn to juggle", "get better at chess", "solve a Rubik's cube", "care for a pet hamster",
    "build a birdhouse", "hang a picture frame", "paint a room", "unclog a sink drain",
    "check the tire pressure on a car", "read a paper map", "use a compass", "build a campfire safely",
    "pitch a tent", "take better photos with a phone", "keep a journal", "make a fruit smoothie",
    "bake chocolate chip cookies", "cook rice on the stove", "make a simple salad dressing",
    "brew green tea", "set a table for dinner", "write a cover letter", "ask for a raise",
    "negotiate a lower price", "resolve an argument with a friend", "apologize sincerely",
    "become a better listener", "manage my time better", "set goals for the new year",
    "start a podcast", "learn to code as a beginner", "speed up a slow computer",
    "clean a cast iron pan", "iron a shirt", "sew on a button", "knit a simple scarf",
    "care for succulents", "keep cut flowers fresh longer", "get rid of fruit flies",
    "make a basic first aid kit", "treat a minor burn", "stay safe during a thunderstorm",
    "teach a child to ride a bike", "make homemade pizza dough", "clean windows without streaks",
    "prepare for a long hike", "choose a good book to read", "improve my posture",
    "learn to touch type", "start a small business", "write a short speech for a wedding",
    "make a family tree", "organize a study schedule", "cook a vegetable stir-fry",
    "plant flower bulbs", "prepare a room for a new baby", "decorate a small apartment",
]

CODE_TASKS = [
    "check whether a string is a palindrome", "compute the sum of a list of numbers",
    "find the smallest number in a list", "count the vowels in a string",
    "convert a temperature from Celsius to Fahrenheit", "convert a temperature from Fahrenheit to Celsius",
    "remove duplicate items from a list", "merge two sorted lists into one sorted list",
    "compute the nth Fibonacci number", "check whether a year is a leap year",
    "count the words in a sentence", "capitalize the first letter of every word in a string",
    "compute the average of a list of numbers", "sort a list of strings by their length",
    "flatten a nested list", "check whether two strings are anagrams",
    "compute the greatest common divisor of two numbers", "generate a random password",
    "read a text file and count its lines", "find the second largest number in a list",
    "convert a list of words to uppercase", "calculate the area of a circle from its radius",
    "return only the even numbers from a list", "check whether a number is a perfect square",
    "swap the keys and values of a dictionary", "find the most common element in a list",
    "remove whitespace from both ends of a string", "check whether a list is sorted",
    "compute the sum of the digits of a number", "convert a decimal number to binary",
    "count the uppercase letters in a string", "find the common elements of two lists",
    "rotate a list by k positions", "check whether a string contains only digits",
    "find the longest word in a sentence", "compute the median of a list of numbers",
    "check whether an email address contains exactly one @ sign", "convert minutes into hours and minutes",
    "calculate simple interest", "print the multiplication table for a number",
    "split a list into chunks of size n", "replace all spaces in a string with underscores",
    "compute the running total of a list", "sum all the numbers from 1 to n",
    "find the longest common prefix of a list of strings", "remove all vowels from a string",
    "calculate a person's age from their birth year", "compute the dot product of two lists",
    "filter out negative numbers from a list", "count how often a character appears in a string",
    "convert a string to title case", "check whether a string is a valid hexadecimal number",
    "return the last n items of a list", "compute the distance between two points",
    "convert kilometers to miles", "find all the divisors of a number",
]

CODE_CONCEPTS = [
    "a variable", "a for loop", "a while loop", "a function", "a list", "a dictionary", "a class",
    "an object", "recursion", "an API", "an exception", "a string", "a boolean", "a compiler",
    "a library", "a Git repository", "a database", "an index in a database", "a hash table",
    "a stack", "a queue", "a linked list", "a binary search", "a sorting algorithm", "Big O notation",
    "a unit test", "debugging", "a syntax error", "a pointer", "an operating system", "a web server",
    "JSON", "HTML", "CSS", "a command-line interface", "version control", "an environment variable",
    "a lambda function", "a module in Python", "a virtual environment",
]

CODE_SNIPPETS = [
    "for i in range(3):\n    print(i * 2)",
    "words = ['sun', 'moon', 'star']\nprint(len(words))",
    "x = 10\nif x > 5:\n    print('big')\nelse:\n    print('small')",
    "nums = [4, 1, 3]\nnums.sort()\nprint(nums)",
    "def greet(name):\n    return 'Hello, ' + name\n\nprint(greet('Ana'))",
    "total = 0\nfor n in [2, 4, 6]:\n    total += n\nprint(total)",
    "s = 'banana'\nprint(s.count('a'))",
    "d = {'a': 1, 'b': 2}\nfor k, v in d.items():\n    print(k, v)",
    "squares = [n * n for n in range(5)]\nprint(squares)",
    "text = 'hello world'\nprint(text.upper())",
    "i = 0\nwhile i < 4:\n    i += 1\nprint(i)",
    "print('-'.join(['a', 'b', 'c']))",
    "def add(a, b=3):\n    return a + b\n\nprint(add(2))",
    "items = [3, 8, 1]\nprint(max(items) - min(items))",
    "name = 'Lina'\nprint(f'{name} has {len(name)} letters')",
    "values = [1, 2, 3, 4]\nprint(values[1:3])",
    "print(list(reversed([1, 2, 3])))",
    "print(sum(range(1, 11)))",
    "colors = ['red', 'blue']\ncolors.append('green')\nprint(colors)",
    "print(7 // 2, 7 % 2)",
    "def is_even(n):\n    return n % 2 == 0\n\nprint([n for n in range(6) if is_even(n)])",
    "pairs = list(zip(['a', 'b'], [1, 2]))\nprint(pairs)",
    "word = 'level'\nprint(word == word[::-1])",
    "counts = {}\nfor ch in 'abca':\n    counts[ch] = counts.get(ch, 0) + 1\nprint(counts)",
    "print(sorted(['pear', 'fig', 'kiwi'], key=len))",
]

BUGGY_SNIPPETS = [
    "def average(nums):\n    return sum(nums) / len(num)",
    "for i in range(5)\n    print(i)",
    "def is_positive(n):\n    if n > 0:\n        return True\n    return 'False'",
    "names = ['a', 'b', 'c']\nprint(names[3])",
    "count = 0\nfor x in [1, 2, 3]:\ncount += x\nprint(count)",
    "def square(n):\n    n * n\n\nprint(square(4))",
    "age = input('Age: ')\nprint(age + 1)",
    "def greet(name):\n    print('Hi ' + Name)",
    "total = 0\nfor n in range(1, 10):\n    total = n\nprint(total)",
    "if x = 5:\n    print('five')",
    "numbers = [3, 1, 2]\nsorted_numbers = numbers.sort()\nprint(sorted_numbers[0])",
    "def last(items):\n    return items[len(items)]",
]

WORDS_TO_DEFINE = [
    "abundant", "ancient", "anxious", "benevolent", "brave", "brief", "candid", "cautious", "clever",
    "curious", "delicate", "diligent", "eager", "elegant", "fragile", "frugal", "generous", "gloomy",
    "graceful", "humble", "idle", "keen", "loyal", "meticulous", "modest", "nimble", "notorious",
    "obscure", "optimistic", "patient", "peculiar", "persistent", "pessimistic", "polite", "precise",
    "reluctant", "resilient", "serene", "shallow", "sincere", "stubborn", "subtle", "tedious",
    "thrifty", "timid", "vague", "vivid", "wary", "witty", "zealous", "ambiguous", "anecdote",
    "benchmark", "catalyst", "consensus", "dilemma", "empathy", "epiphany", "habitat", "hypothesis",
    "irony", "metaphor", "nostalgia", "paradox", "perspective", "phenomenon", "procrastination",
    "resilience", "routine", "sarcasm", "symbol", "tradition", "trivia", "ubiquitous", "whimsical",
    "wanderlust", "ecosystem", "economy", "innovation", "integrity", "justice", "literacy",
    "migration", "negotiation", "prejudice", "sustainability", "tolerance", "abandon", "accumulate",
    "adapt", "advocate", "allocate", "anticipate", "collaborate", "compromise", "contemplate",
    "deteriorate", "elaborate", "emphasize", "endure", "evaluate", "flourish", "hesitate",
    "illuminate", "improvise", "interpret", "persuade", "postpone", "prioritize", "scrutinize",
    "speculate", "thrive", "wander", "yearn", "gratitude", "solitude", "curiosity", "ambition",
    "courtesy", "humility", "diversity", "hospitality", "melancholy", "serendipity", "frivolous",
    "gregarious", "inevitable", "lucid", "mundane", "novice", "obsolete", "pragmatic", "quaint",
    "rigorous", "spontaneous", "tangible", "versatile",
]

COMPARE_PAIRS = [
    ("a virus", "a bacterium"), ("weather", "climate"), ("a city", "a town"), ("a mountain", "a hill"),
    ("a sea", "an ocean"), ("a planet", "a star"), ("an asteroid", "a comet"), ("a meteor", "a meteorite"),
    ("speed", "velocity"), ("mass", "weight"), ("heat", "temperature"), ("an atom", "a molecule"),
    ("an element", "a compound"), ("a solid", "a liquid"), ("DNA", "RNA"), ("a democracy", "a monarchy"),
    ("a republic", "a democracy"), ("socialism", "capitalism"), ("a loan", "a grant"),
    ("saving", "investing"), ("a debit card", "a credit card"), ("a stock", "a bond"),
    ("renting a home", "buying a home"), ("a laptop", "a desktop computer"), ("RAM", "storage"),
    ("hardware", "software"), ("a compiler", "an interpreter"), ("Python", "JavaScript"),
    ("a list", "a tuple in Python"), ("HTTP", "HTTPS"), ("a website", "a web app"),
    ("email", "text messages"), ("tea", "coffee"), ("baking", "frying"), ("butter", "margarine"),
    ("a herb", "a spice"), ("a novel", "a short story"), ("a poem", "a song"), ("fiction", "nonfiction"),
    ("a simile", "a metaphor"), ("an adjective", "an adverb"), ("a noun", "a verb"),
    ("British English", "American English"), ("a cold", "the flu"), ("a sprint", "a marathon"),
    ("yoga", "pilates"), ("running", "walking"), ("soccer", "rugby"), ("chess", "checkers"),
    ("a violin", "a viola"), ("a guitar", "a ukulele"), ("a piano", "an organ"),
    ("a painting", "a photograph"), ("a teacher", "a tutor"), ("a job", "a career"),
    ("a manager", "a leader"), ("a want", "a need"), ("a habit", "a routine"),
    ("optimism", "realism"), ("a democracy", "a dictatorship"), ("a train", "a bus"),
    ("an electric car", "a petrol car"), ("solar power", "wind power"), ("a hurricane", "a tornado"),
    ("a desert", "a tundra"), ("a rainforest", "a temperate forest"), ("a glacier", "an iceberg"),
    ("a cave", "a canyon"), ("a museum", "an art gallery"), ("a library", "a bookstore"),
    ("breakfast", "brunch"), ("a circle", "an oval"), ("the mean", "the median"),
    ("a fraction", "a decimal"), ("addition", "multiplication"), ("a rabbit", "a hare"),
    ("a crow", "a raven"), ("a lake", "a reservoir"), ("a river", "a stream"), ("rain", "sleet"),
    ("fog", "mist"), ("a plateau", "a valley"), ("an island", "a peninsula"), ("an essay", "a report"),
    ("a podcast", "a radio show"), ("a tablet", "a smartphone"), ("wool", "cotton"),
    ("a sandwich", "a wrap"), ("jam", "jelly"), ("a lime", "a lemon"),
]

ADVICE_GERUNDS = [
    "learning to play the guitar", "starting a new job", "moving to a new city", "adopting a dog",
    "buying a used car", "going to college", "learning to swim as an adult", "starting a blog",
    "running a first marathon", "traveling alone", "working from home", "learning to cook",
    "planting a garden", "writing a novel", "volunteering", "starting a fitness routine",
    "learning photography", "saving for retirement", "going camping for the first time",
    "hosting a dinner party", "learning to draw", "studying abroad", "changing careers",
    "joining a sports team", "starting to meditate", "buying a first home", "raising chickens",
    "learning a musical instrument", "taking a gap year", "starting a book club",
    "cycling to work", "learning to dance", "teaching a class for the first time",
    "making a big purchase", "renovating a kitchen", "getting a pet cat", "learning sign language",
    "going on a road trip", "speaking in public", "living with roommates",
]

ADVICE_TOPICS = [
    "staying focused while studying", "sleeping better", "eating healthier on a budget",
    "making friends as an adult", "dealing with stress at work", "keeping a tidy home",
    "being more confident", "handling criticism", "managing screen time", "staying motivated to exercise",
    "writing clear emails", "preparing for exams", "talking to a shy child", "saving energy at home",
    "choosing a good password", "staying safe online", "drinking more water", "waking up early",
    "being more productive in the morning", "keeping plants alive", "traveling with kids",
    "reducing food waste", "learning from mistakes", "being a good team member", "keeping a conversation going",
]

SENTENCES = [
    "The meeting starts at nine o'clock tomorrow morning.",
    "I think we should go to the park after lunch.",
    "The new library has thousands of books and a quiet reading room.",
    "My brother is learning to play the piano this year.",
    "We need to buy milk, eggs and bread before the shop closes.",
    "The weather is nice today, so let's eat outside.",
    "She finished the report late last night.",
    "Our team won the match because everyone worked hard.",
    "The train was delayed by twenty minutes because of the snow.",
    "Please send me the files by Friday afternoon.",
    "The children are building a sandcastle on the beach.",
    "He forgot his umbrella and got wet on the way home.",
    "The restaurant on the corner serves delicious soup.",
    "I can't come to the party because I have to work.",
    "The museum is closed on Mondays for cleaning.",
    "They planted three apple trees in their garden.",
    "The printer in the office is broken again.",
    "My grandmother tells the best stories about her childhood.",
    "We are planning a trip to the mountains next summer.",
    "The students listened carefully to the teacher.",
    "This phone is too expensive for me.",
    "The river flows slowly through the green valley.",
    "I really liked the movie we watched last weekend.",
    "The company will hire five new workers next month.",
    "Can you help me carry these heavy boxes?",
    "The concert was cancelled because the singer was sick.",
    "My neighbor walks her dog every morning at seven.",
    "The soup needs a little more salt.",
    "We should leave early to avoid the traffic.",
    "The old bridge was repaired last year.",
    "He is the fastest runner in our school.",
    "The cake smells wonderful and looks beautiful.",
    "I lost my keys somewhere in the house.",
    "The city council approved the plan for a new park.",
    "Reading before bed helps me relax.",
    "The store is having a big sale this weekend.",
    "My computer runs very slowly in the afternoon.",
    "The farmers are worried about the lack of rain.",
    "Our flight leaves at six in the evening.",
    "The baby finally fell asleep after an hour.",
    "I will call you when I get home.",
    "The scientists discovered a new species of frog in the forest.",
    "Please turn off the lights when you leave the room.",
    "The kids were excited about the school trip.",
    "This recipe is easy to follow and takes thirty minutes.",
    "The wind knocked over the fence during the storm.",
    "We painted the kitchen a bright yellow color.",
    "The hotel room had a view of the sea.",
    "She always drinks a glass of water before breakfast.",
    "The bus was full, so we had to wait for the next one.",
    "Our teacher gave us a lot of homework today.",
    "The new app makes it easy to track your spending.",
    "He was nervous before his first job interview.",
    "The garden looks lovely in the spring.",
    "They argued about which movie to watch.",
    "I have been waiting for the package for two weeks.",
    "The coffee machine makes a strange noise.",
    "Everyone clapped when the play ended.",
    "The road to the village is narrow and steep.",
    "We ran out of paper in the middle of the exam.",
]

BAD_GRAMMAR = [
    "She don't like apples.", "Me and him goes to school together.", "They was very happy yesterday.",
    "I has three cats.", "He go to work every days.", "The dogs is barking loud.",
    "We was late for the bus.", "There is many people here.", "Him and me are best friend.",
    "She have finished her homeworks.", "I seen that movie last week.", "The childrens plays outside.",
    "He don't know nothing about it.", "Their going to the beach tomorrow.",
    "Your the best teacher I ever had.", "The book who I read was good.", "I am agree with you.",
    "She can sings very well.", "We goed to the zoo on Sunday.", "Each of the students have a book.",
    "He runned to the store.", "Its a beautiful day today.", "Between you and I, it's a secret.",
    "There car is red.", "I didn't went to the party.", "Who's book is this?",
    "The informations are on the table.", "She is more taller than her sister.",
    "I look forward to meet you.", "Less people came than expected.",
]

REWRITE_TEMPLATES = [
    "Rewrite this sentence in a formal tone: {s}",
    "Rewrite this sentence in a casual, friendly tone: {s}",
    "Make this sentence shorter: {s}",
    "Rewrite this sentence using simpler words: {s}",
    "Rewrite this sentence to sound more polite: {s}",
    "Paraphrase this sentence: {s}",
    "Rewrite this sentence as a question: {s}",
    "Make this sentence more exciting: {s}",
    "Rewrite this sentence in the future tense: {s}",
    "Translate this sentence into Spanish: {s}",
    "Translate this sentence into French: {s}",
    "Rewrite this sentence from the point of view of a pirate: {s}",
]

PASSAGES = [
    "Honeybees live in large colonies led by a single queen. Worker bees collect nectar and pollen "
    "from flowers, and in doing so they help plants reproduce. A healthy hive can contain tens of "
    "thousands of bees, each with a specific job.",
    "The town library will extend its opening hours starting next month. It will now stay open until "
    "eight in the evening on weekdays. The library hopes that students and working adults will find "
    "it easier to visit.",
    "Regular walking is one of the simplest forms of exercise. It strengthens the heart, improves mood "
    "and helps with sleep. Experts recommend about thirty minutes of brisk walking on most days.",
    "In the nineteenth century, railways changed how people traveled. Journeys that once took days "
    "could be completed in hours. Towns along the railway lines grew quickly as trade increased.",
    "Maya had always wanted to learn to paint. At forty, she signed up for an evening class. Her first "
    "pictures were messy, but after a year her landscapes were shown in a small local gallery.",
    "Coral reefs cover less than one percent of the ocean floor, yet they are home to about a quarter "
    "of all marine species. Rising sea temperatures can cause corals to lose their color and die, a "
    "process known as bleaching.",
    "The company announced a new phone with a larger screen and a longer-lasting battery. The price "
    "will be slightly higher than the previous model. Sales begin in three weeks.",
    "Composting turns food scraps and garden waste into rich soil. It reduces the amount of rubbish "
    "sent to landfills. A simple compost pile needs a mix of green material, brown material, air and water.",
    "The first bicycles had no pedals; riders pushed themselves along with their feet. Pedals were "
    "added later, and air-filled tires made rides much more comfortable. Today, bicycles are used by "
    "millions of people to commute.",
    "A local bakery has started giving its unsold bread to a nearby shelter each evening. The owner "
    "says she hated throwing food away. Other shops in the area are now thinking of doing the same.",
    "Sleep is important for memory. While we sleep, the brain sorts and stores information from the "
    "day. People who sleep poorly often find it harder to concentrate and learn new things.",
    "The Great Barrier Reef lies off the coast of Australia and stretches for more than two thousand "
    "kilometers. It can be seen from space. Many tourists visit every year to snorkel and dive.",
    "Tom missed the last bus home, so he decided to walk. On the way, he found a lost puppy and carried "
    "it to the nearest animal shelter. The owners called him the next day to thank him.",
    "Volcanoes form where molten rock from deep inside the Earth reaches the surface. Some erupt "
    "violently, while others release lava slowly. Volcanic soil is often very fertile, which is why "
    "farms are common near volcanoes.",
    "The school will hold its annual science fair on the last Friday of May. Students can work alone "
    "or in pairs. Prizes will be given for the most creative and the most useful projects.",
    "Tea was first drunk in China thousands of years ago. It later spread to Japan, India and Europe. "
    "Today it is one of the most popular drinks in the world, second only to water.",
    "Electric cars are becoming more common. They produce no exhaust fumes and are cheaper to run, but "
    "they can take a long time to charge. Many cities are building more charging stations.",
    "Octopuses are remarkably intelligent animals. They can open jars, solve simple puzzles and change "
    "the color of their skin to hide from predators. Each of their eight arms can taste what it touches.",
    "The city plans to plant ten thousand trees over the next five years. Trees provide shade, clean "
    "the air and make streets more pleasant. Residents can request a tree for their street online.",
    "Learning a second language can improve memory and problem-solving skills. It also makes travel "
    "easier and opens up new job opportunities. Even fifteen minutes of practice a day can help.",
    "Penicillin was discovered by accident in 1928 when a scientist noticed mould killing bacteria in "
    "a dish. It became the first widely used antibiotic and has saved millions of lives.",
    "Our hiking group met at dawn and climbed for four hours. The path was steep and rocky, but the "
    "view from the top was worth it. We ate lunch beside a small lake before heading down.",
    "Many deserts are cold rather than hot. A desert is defined by how little rain it receives, not by "
    "its temperature. Antarctica is the largest desert in the world.",
    "The museum has opened a new exhibition about ancient Egypt. Visitors can see jewelry, tools and a "
    "real mummy. The exhibition will run until the end of the year.",
    "Bamboo is one of the fastest-growing plants on Earth. Some kinds can grow almost a meter in a "
    "single day. It is used to build houses, furniture and even bicycles.",
    "A new study found that people who spend time in nature feel calmer and happier. Even a short walk "
    "in a park can lower stress. The researchers suggest spending at least two hours a week outdoors.",
    "The recipe is simple: mix flour, water, salt and yeast, then let the dough rest for two hours. "
    "Shape it into a loaf and bake it in a hot oven until the crust is golden.",
    "Lina's grandfather kept bees for fifty years. Every summer she helped him collect honey. When he "
    "retired, he gave her his old wooden hives, and she now sells honey at the weekend market.",
    "The internet began as a small network connecting a few universities. Over time it grew to link "
    "billions of devices around the world. Today it is used for work, learning, shopping and entertainment.",
    "Recycling one aluminum can saves enough energy to run a television for several hours. Aluminum "
    "can be recycled again and again without losing quality.",
    "The football club has signed a young goalkeeper from a local academy. The coach praised his quick "
    "reactions and calm attitude. He is expected to play in the first team next season.",
    "Hedgehogs are small mammals covered in spines. When they feel threatened, they roll into a tight "
    "ball. They eat insects, worms and snails, which makes them popular with gardeners.",
    "Our neighborhood held its first street party last Saturday. Families brought food to share, "
    "children played games and a local band performed in the evening. Everyone agreed it should become a yearly event.",
    "Glaciers are huge, slow-moving rivers of ice. They form where more snow falls in winter than "
    "melts in summer. Many glaciers are shrinking because of warmer temperatures.",
    "The airline has introduced a new rule: passengers may bring only one small bag on board. Larger "
    "bags must be checked in. The company says this will help flights leave on time.",
    "Chess is thought to have started in India about 1,500 years ago. The game spread through Persia "
    "to Europe, where its rules slowly changed into the ones we use today.",
]

SUMMARY_TEMPLATES = [
    "Summarize the following text in one sentence:\n\n{p}",
    "Give a short summary of this paragraph:\n\n{p}",
    "What is the main idea of this text?\n\n{p}",
    "Summarize this text in three bullet points:\n\n{p}",
    "Write a good title for this paragraph:\n\n{p}",
    "List the key facts in this text:\n\n{p}",
    "Explain this paragraph to a young child:\n\n{p}",
    "Read the text below and write two questions about it.\n\n{p}",
]

CREATIVE_TOPICS = [
    "the ocean", "autumn leaves", "a rainy Monday", "friendship", "a lighthouse", "the city at night",
    "an old clock", "a cup of coffee", "the first snow of winter", "a summer garden", "the mountains",
    "a lonely robot", "homework", "a lost sock", "a thunderstorm", "the desert", "a busy market",
    "a quiet library", "a train journey", "a grandmother's kitchen", "courage", "hope", "time",
    "music", "a birthday", "a sunrise", "a forest path", "a city park", "a candle", "a paper boat",
    "the sea at dawn", "a sleepy kitten", "an old bridge", "the wind", "a rainbow after the rain",
    "a school bus", "the last day of summer", "a new pair of shoes", "a tiny seed", "the night sky",
    "a lazy Sunday", "a busy airport", "a mountain lake", "a hot bowl of soup", "a traffic jam",
    "a music box", "an empty playground", "the smell of fresh bread", "a broken umbrella",
    "a letter from far away", "a fox in the snow", "a field of sunflowers", "the sound of rain",
    "a childhood memory", "the moon over the sea", "a cat watching birds", "a windy beach",
    "an old photograph", "a garden in spring", "a long road trip",
]

CREATIVE_FORMS = [
    "Write a short poem about {t}.", "Write a haiku about {t}.", "Write a limerick about {t}.",
    "Write a four-line rhyming poem about {t}.", "Write a two-sentence story about {t}.",
    "Describe {t} using all five senses.", "Write a short, cheerful song verse about {t}.",
]

CHARACTERS = [
    "a shy dragon", "a curious young inventor", "an old fisherman", "a talking teapot", "a lost astronaut",
    "a brave little mouse", "a grumpy wizard", "a girl with the gift of talking to birds", "a retired detective",
    "a friendly giant", "a robot chef", "a nervous knight", "a clever raccoon", "a lonely lighthouse keeper",
    "a time-traveling librarian", "a tiny elephant", "a young pirate", "a ghost afraid of people",
    "a baker without a sense of taste", "a boy with a magic pencil", "a forgetful superhero", "a musical squirrel",
    "a penguin with dreams of flying", "an ant with big dreams", "a kind witch", "a sleepy bear",
    "a new student at a strange school", "a village doctor", "a street musician", "a map maker",
]

STORY_GOALS = [
    "finds a mysterious key", "wants to win a baking contest", "gets lost in a big city",
    "makes an unexpected friend", "discovers a hidden door", "has to save a village from a flood",
    "learns to be patient", "goes on a journey to the sea", "tries to fix a broken clock tower",
    "receives a letter from the future", "must cross a dangerous mountain", "opens a tiny shop",
    "loses their voice before a big performance", "finds a treasure map in an old book",
    "helps a lost animal get home", "wakes up with a strange new power", "builds a flying machine",
    "spends a night in a museum", "plants a magic seed", "has to keep a big secret",
]

PLACES = [
    "a snowy mountain village", "an abandoned amusement park", "a busy train station",
    "a small island", "an old castle", "a space station", "a desert town", "a floating city",
    "a quiet seaside town", "a rainy city", "a school at night", "a forest cabin",
    "an underwater research base", "a crowded night market", "a lighthouse on a cliff",
]

RECIPIENTS = [
    "my manager", "a coworker", "my teacher", "a new neighbor", "a customer", "my landlord",
    "an old friend", "my team", "a client", "my aunt", "a former classmate", "my sports coach",
]

# Purposes that make sense for any recipient above.
GENERIC_PURPOSES = [
    "to thank them for their help", "to apologize for a late reply", "to share some good news",
    "to say goodbye before moving away", "to invite them to a small party", "to wish them a happy birthday",
    "to ask how they have been", "to suggest meeting for coffee",
]

# (recipient, purpose) pairs that only make sense together.
SPECIFIC_EMAILS = [
    ("my manager", "asking for a day off next Friday"), ("my manager", "asking for feedback on a project"),
    ("my manager", "to suggest a new idea for the team"), ("my manager", "to ask for an extension on a deadline"),
    ("a coworker", "to reschedule a meeting"), ("a coworker", "asking them to review a document"),
    ("my teacher", "asking for a recommendation letter"), ("my teacher", "to explain why I missed class"),
    ("my teacher", "asking a question about the homework"), ("a new neighbor", "to welcome them to the street"),
    ("a new neighbor", "to complain politely about late-night noise"), ("a customer", "to confirm their order has shipped"),
    ("a customer", "to apologize for a delayed delivery"), ("a customer", "to thank them for a positive review"),
    ("my landlord", "to report a broken heater"), ("my landlord", "to ask about renewing the lease"),
    ("my team", "to welcome a new member"), ("my team", "to announce a change in the meeting schedule"),
    ("my team", "to celebrate finishing a big project"), ("a client", "to send a project update"),
    ("a client", "to request a copy of a signed contract"), ("a client", "to follow up on an unpaid invoice"),
    ("a hotel", "to confirm a reservation for two nights"), ("a hotel", "to ask whether breakfast is included"),
    ("a restaurant", "to book a table for six people"), ("a restaurant", "to ask about vegetarian options"),
    ("a library", "to ask about opening hours during the holidays"), ("a library", "to ask for a book to be reserved"),
    ("a local newspaper", "to suggest a story about a community garden"), ("my doctor's office", "to cancel an appointment"),
    ("my doctor's office", "to ask for a copy of my test results"), ("a school principal", "to propose a reading club"),
    ("my sports coach", "to explain that I will miss practice"), ("a former classmate", "to organize a reunion"),
]

GIFTS = [
    "a birthday present", "a handwritten card", "a homemade cake", "a book recommendation",
    "help with moving house", "a wonderful dinner", "looking after my cat", "a lovely scarf",
    "a surprise party", "their advice",
]
THANK_RECIPIENTS = ["my aunt", "a friend", "my teacher", "a neighbor", "my grandparents", "a coworker"]

JOBS = [
    "a library assistant", "a junior web developer", "a barista", "a museum guide", "a camp counselor",
    "a bookkeeper", "a delivery driver", "a gardener", "a dental receptionist", "a hotel receptionist",
    "a lab technician", "a swimming instructor", "a graphic designer", "a bakery assistant", "a tutor",
]

PRODUCTS = [
    "a reusable water bottle", "a solar-powered phone charger", "a pair of noise-cancelling headphones",
    "a handmade wooden chair", "a smart alarm clock", "a lightweight hiking backpack",
    "an organic honey jar", "a board game for families", "a folding bicycle", "a cozy wool blanket",
    "a ceramic coffee mug", "a beginner's guitar", "a plant-based cookbook", "an electric toothbrush",
    "a waterproof watch", "a children's picture book", "a set of colored pencils", "a desk lamp",
    "a yoga mat", "a travel pillow", "a robot vacuum cleaner", "a fresh bakery loaf",
    "a language learning app", "a bird feeder", "a pair of running shoes",
]

OCCASIONS = [
    "a school bake sale", "a neighborhood cleanup day", "a charity fun run", "a book club meeting",
    "a retirement party", "a summer barbecue", "a science fair", "a garden open day",
    "a farewell party for a coworker", "a chess tournament", "a family reunion", "a movie night",
    "a craft workshop", "a concert in the park", "a holiday dinner",
]

NAMES = [
    "Ana", "Ben", "Chloe", "David", "Elena", "Farid", "Grace", "Hiro", "Isla", "Jamal", "Kira", "Leo",
    "Mina", "Noah", "Olivia", "Pablo", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Will", "Yara",
    "Zane", "Amir", "Bella", "Carlos", "Dina", "Ethan", "Fatima", "Gabe", "Hana", "Ivan", "Jade",
]
PRONOUNS = {
    "Ana": "she", "Ben": "he", "Chloe": "she", "David": "he", "Elena": "she", "Farid": "he",
    "Grace": "she", "Hiro": "he", "Isla": "she", "Jamal": "he", "Kira": "she", "Leo": "he",
    "Mina": "she", "Noah": "he", "Olivia": "she", "Pablo": "he", "Quinn": "they", "Rosa": "she",
    "Sam": "they", "Tara": "she", "Umar": "he", "Vera": "she", "Will": "he", "Yara": "she",
    "Zane": "he", "Amir": "he", "Bella": "she", "Carlos": "he", "Dina": "she", "Ethan": "he",
    "Fatima": "she", "Gabe": "he", "Hana": "she", "Ivan": "he", "Jade": "she",
}

COUNT_ITEMS = [
    "marbles", "stamps", "seashells", "postcards", "cookies", "stickers", "oranges", "books",
    "toy cars", "beads", "muffins", "coins", "trading cards", "balloons", "crayons", "tulips",
    "cupcakes", "paper cranes", "buttons", "plums",
]

SHOP_ITEMS = [
    ("sandwiches", 4), ("juice boxes", 2), ("comic books", 6), ("plant pots", 7), ("candles", 5),
    ("tennis balls", 3), ("scarves", 12), ("mugs", 8), ("bags of rice", 9), ("notecards", 1),
    ("umbrellas", 15), ("lemons", 1), ("puzzles", 11), ("pairs of socks", 4), ("bottles of water", 2),
]

FRUITS_TRAIN = [
    "pear", "pineapple", "kiwi", "cherry", "peach", "plum", "orange", "lemon", "watermelon",
    "blueberry", "raspberry", "apricot", "papaya", "fig", "pomegranate", "coconut", "lime", "melon",
]
VEGETABLES_TRAIN = [
    "spinach", "lettuce", "cabbage", "onion", "celery", "cauliflower", "beetroot", "radish", "turnip",
    "asparagus", "kale", "leek", "parsnip", "artichoke", "garlic",
]

ODD_ONE_GROUPS = {
    "fruits": ["pear", "peach", "plum", "cherry", "kiwi", "lime", "fig", "melon"],
    "colors": ["purple", "orange", "pink", "brown", "gray", "violet", "teal", "gold"],
    "vehicles": ["bus", "truck", "bicycle", "tram", "scooter", "van", "taxi", "ferry"],
    "instruments": ["violin", "flute", "drum", "trumpet", "harp", "cello", "banjo", "piano"],
    "tools": ["hammer", "saw", "wrench", "drill", "shovel", "chisel", "pliers", "rake"],
    "clothes": ["jacket", "skirt", "sweater", "scarf", "glove", "coat", "sock", "hat"],
    "furniture": ["sofa", "desk", "bed", "shelf", "stool", "wardrobe", "bench", "armchair"],
    "weather": ["rain", "snow", "hail", "fog", "sleet", "drizzle", "thunder", "frost"],
    "body parts": ["elbow", "knee", "wrist", "ankle", "shoulder", "chin", "thumb", "ear"],
    "sports": ["tennis", "hockey", "golf", "rugby", "cricket", "volleyball", "baseball", "boxing"],
}

POS_REVIEWS = [
    "arrived quickly and works perfectly", "is the best purchase I have made this year",
    "exceeded all my expectations", "is comfortable and very well made", "was worth every penny",
    "made my mornings so much easier", "looks beautiful and is easy to use",
    "has great battery life and a lovely design", "was a thoughtful gift and my sister loved it",
    "is sturdy, simple and does exactly what it promises",
]
NEG_REVIEWS = [
    "stopped working after two days", "was much smaller than the pictures suggested",
    "arrived broken and customer service never replied", "is uncomfortable and feels cheap",
    "was a complete waste of money", "makes a terrible noise every time I use it",
    "smells strange and the color faded quickly", "took six weeks to arrive and was the wrong size",
    "is confusing to set up and the instructions are useless", "broke the first time my son used it",
]
NEU_REVIEWS = [
    "arrived on Tuesday", "is available in three colors", "comes in a cardboard box",
    "is about the same as my old one", "does what it says, nothing more and nothing less",
]
REVIEW_PRODUCTS = [
    "blender", "backpack", "lamp", "kettle", "phone case", "jacket", "toaster", "desk chair",
    "water bottle", "pair of boots", "keyboard", "umbrella", "suitcase", "board game", "frying pan",
]

SENTENCE_TYPES = [
    "Close the window, please.", "The library opens at nine.", "Where did you put my glasses?",
    "Bring your notebook tomorrow.", "Do you like spicy food?", "The sun sets behind the hills.",
    "Why is the shop closed today?", "Please sit down.", "My sister plays the violin.",
    "Turn left at the next corner.", "How old is your cat?", "The soup is too hot to eat.",
    "Can you hear the music?", "Wash your hands before dinner.", "Owls can turn their heads very far.",
    "What time does the film start?", "Don't touch the wet paint.", "The garden is full of roses.",
]

POS_WORDS = {
    "noun": ["table", "river", "teacher", "idea", "garden", "music", "window", "friendship", "mountain", "pencil"],
    "verb": ["run", "build", "whisper", "explore", "jump", "write", "carry", "listen", "dance", "grow"],
    "adjective": ["bright", "noisy", "gentle", "heavy", "clever", "ancient", "smooth", "angry", "calm", "shiny"],
}

HEADLINES = [
    ("Local team wins championship after dramatic penalty shootout", "sports"),
    ("Scientists discover water ice on a distant moon", "science"),
    ("Parliament votes on new education law", "politics"),
    ("Tech company reports record profits this quarter", "business"),
    ("Famous actor announces new film about space travel", "entertainment"),
    ("New species of deep-sea fish found near volcanic vents", "science"),
    ("Mayor promises more bike lanes before the election", "politics"),
    ("Coffee prices rise as harvest falls short", "business"),
    ("Pop star's world tour sells out in minutes", "entertainment"),
    ("Marathon runner breaks national record", "sports"),
    ("Researchers build battery that charges in five minutes", "science"),
    ("Small bakery chain opens ten new stores", "business"),
    ("Tennis veteran retires after twenty seasons", "sports"),
    ("Government announces new plan to cut air pollution", "politics"),
    ("Animated film wins top prize at festival", "entertainment"),
]

SORT_WORDS = [
    "river", "maple", "copper", "lantern", "violet", "harbor", "pencil", "meadow", "candle", "orbit",
    "saddle", "tulip", "basket", "canyon", "dolphin", "ember", "falcon", "garnet", "hazel", "igloo",
    "jacket", "kettle", "ladder", "magnet", "nectar", "oyster", "pepper", "quartz", "ribbon", "sparrow",
    "timber", "velvet", "walnut", "yogurt", "anchor", "bamboo", "cactus", "dragon", "engine", "feather",
]

DATES = [
    ("March", 14, 2021), ("July", 4, 1999), ("January", 30, 2010), ("October", 9, 2023),
    ("May", 21, 1987), ("December", 25, 2005), ("August", 2, 2016), ("February", 11, 2000),
    ("September", 17, 1994), ("April", 6, 2012), ("November", 28, 2019), ("June", 13, 2008),
]

FACT_OR_OPINION = [
    "Water freezes at zero degrees Celsius.", "Summer is the best season of the year.",
    "The Pacific Ocean is larger than the Atlantic Ocean.", "Chocolate ice cream tastes better than vanilla.",
    "The Amazon rainforest is in South America.", "Cats make better pets than dogs.", "Mount Kilimanjaro is in Africa.",
    "Math is the most boring school subject.", "Bees help pollinate flowers.", "Rainy days are depressing.",
    "The human body has 206 bones.", "Jazz is more relaxing than rock music.",
    "Spiders are not insects.", "Everyone should learn to play chess.",
    "Light travels faster than sound.", "This city has the friendliest people in the world.",
]


# Short-answer questions. Entities differ from the short eval set by construction (and the
# near-duplicate filter below removes any that still collide).
ANTONYM_WORDS = [
    "heavy", "loud", "strong", "wide", "deep", "sharp", "clean", "sweet", "awake", "true", "first",
    "north", "east", "before", "remember", "arrive", "borrow", "accept", "teach", "question", "friend",
    "summer", "morning", "healthy", "cheap", "thick", "narrow", "brave", "polite", "smooth", "ancient",
    "generous", "noisy", "visible", "possible", "entrance", "maximum", "increase", "victory", "asleep",
]
PAST_TENSE_VERBS = [
    "drink", "fly", "begin", "speak", "take", "bring", "catch", "teach", "drive", "fall", "forget",
    "ride", "wear", "keep", "sleep", "choose", "grow", "throw", "build", "feel", "leave", "find",
]
PLURAL_NOUNS = [
    "cactus", "city", "wolf", "bus", "dish", "story", "hero", "ox", "half", "life", "loaf", "shelf",
    "berry", "church", "fox", "glass", "party", "calf", "wish", "country",
]
SHAPES_SIDES = ["square", "pentagon", "octagon", "rectangle", "decagon"]
COLOR_MIXES = [("blue", "yellow"), ("red", "white"), ("red", "yellow"), ("black", "white"), ("red", "blue")]
BABY_ANIMALS = ["sheep", "cow", "horse", "goat", "duck", "frog", "kangaroo", "bear", "owl", "pig"]
SHORT_FACT_QUESTIONS = [
    "What is the largest continent?", "Which animal is known as the ship of the desert?",
    "What is the chemical symbol for iron?", "What is the chemical symbol for silver?",
    "What is the freezing point of water in degrees Fahrenheit?", "What is the hardest natural substance?",
    "What is the largest bird in the world?", "How many strings does a standard guitar have?",
    "How many players from one team are on a basketball court at a time?",
    "What is the main ingredient in guacamole?", "What do pandas mainly eat?",
    "How many teeth does an adult human usually have?", "What is the name of the galaxy we live in?",
    "Who invented the telephone?", "Who developed the theory of relativity?", "Who discovered penicillin?",
    "What is the longest bone in the human body?", "How many centimeters are in a meter?",
    "How many grams are in a kilogram?", "How many years are in a century?", "How many years are in a decade?",
    "How many weeks are in a year?", "How many players are on a soccer team on the field?",
    "What color is a ripe tomato?", "What color is a glass of milk?",
    "Which metal is liquid at room temperature?", "What is the name of a shape with eight sides?",
    "What do you call a scientist who studies rocks?", "What instrument has 88 keys?",
    "What is the currency of the United Kingdom?", "What is the primary language spoken in Mexico?",
    "Which ocean lies between Africa and Australia?",
    "What is the largest organ of the human body?", "Which planet is famous for its rings?",
    "What is the name of the line that divides the Earth into the Northern and Southern Hemispheres?",
    "What do caterpillars eat?", "How many bones are in the adult human body?",
    "What is the square root of 144?",
]

_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                 "eleven", "twelve"]


# --------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------

def _article(noun_phrase: str) -> str:
    """Return the noun phrase with a/an in front."""
    return ("an " if noun_phrase[0].lower() in "aeiou" else "a ") + noun_phrase


def _third_person(phrase: str) -> str:
    """Conjugate the leading verb of an infinitive phrase to third person singular."""
    verb, _, rest = phrase.partition(" ")
    if verb.endswith(("s", "x", "z", "ch", "sh")):
        verb += "es"
    elif verb.endswith("y") and verb[-2] not in "aeiou":
        verb = verb[:-1] + "ies"
    else:
        verb += "s"
    return f"{verb} {rest}".strip()


def _unique(prompts: Iterable[str]) -> list[str]:
    """Drop repeated prompts while keeping first-seen order."""
    seen: set[str] = set()
    out: list[str] = []
    for prompt in prompts:
        if prompt not in seen:
            seen.add(prompt)
            out.append(prompt)
    return out


def _sample_unique(make: Callable[[random.Random], str], rng: random.Random, count: int) -> list[str]:
    """Draw up to count distinct prompts from a randomised maker (bounded attempts)."""
    out: dict[str, None] = {}
    attempts = 0
    while len(out) < count and attempts < count * 20:
        out[make(rng)] = None
        attempts += 1
    return list(out)


# --------------------------------------------------------------------------------------
# Category generators: each returns a list of prompts (order is deterministic)
# --------------------------------------------------------------------------------------

def _facts_geography(rng: random.Random) -> list[str]:
    """Country and city questions."""
    country_t = [
        "What is the capital of {c}?", "Tell me three interesting facts about {c}.",
        "What languages are spoken in {c}?", "On which continent is {c}?",
        "Describe the climate of {c} in a few sentences.", "What traditional foods is {c} known for?",
        "Give a brief overview of the history of {c}.", "What currency is used in {c}?",
        "Name two famous landmarks in {c}.", "What would a tourist enjoy seeing in {c}?",
    ]
    city_t = [
        "What is {c} famous for?", "Which country is {c} in?", "Describe the city of {c} in three sentences.",
        "Suggest a one-day sightseeing plan for {c}.",
    ]
    out = [t.format(c=c) for c in COUNTRIES for t in country_t]
    out += [t.format(c=c) for c in CITIES for t in city_t]
    return out


def _facts_nature(rng: random.Random) -> list[str]:
    """Animal questions."""
    templates = [
        "What do {pl} eat?", "Where do {pl} live?", "Describe {a} in two or three sentences.",
        "How do {pl} protect themselves from predators?", "Give three fun facts about {pl}.",
        "How long do {pl} usually live?", "How do {pl} care for their young?",
        "Write a short paragraph about {pl} for a children's book.",
    ]
    return [t.format(pl=pl, a=_article(sg)) for sg, pl in ANIMALS for t in templates]


def _facts_history(rng: random.Random) -> list[str]:
    """Questions about historical people and events."""
    person_t = [
        "Who was {p}?", "What is {p} best known for?", "Write a short biography of {p}.",
        "Why is {p} considered important in history?", "Give three facts about {p}.",
    ]
    event_t = [
        "Give a short overview of {e}.", "Why was {e} important?",
        "Explain {e} to a high school student.", "What changed in everyday life because of {e}?",
    ]
    out = [t.format(p=p) for p in PEOPLE for t in person_t]
    out += [t.format(e=e) for e in EVENTS for t in event_t]
    return out


def _explanations(rng: random.Random) -> list[str]:
    """Concept explanations and why-questions."""
    templates = [
        "Explain {c} in simple terms.", "Explain {c} to a ten-year-old.", "Give a short explanation of {c}.",
        "Write a paragraph that explains {c}.", "What should a beginner know about {c}?",
        "Why is it useful to understand {c}?",
    ]
    out = [t.format(c=c) for c in SCIENCE_CONCEPTS for t in templates]
    for q in WHY_QUESTIONS:
        out += [q, f"Answer in two sentences: {q}", f"Explain to a child: {q}"]
    return out


def _lists(rng: random.Random) -> list[str]:
    """Requests for short lists of things."""
    templates = [
        "List {k} {x}.", "Name {k} {x}.", "Give me a list of {k} {x}.", "What are {k} examples of {x}?",
        "Write a bulleted list of {k} {x}.", "Can you name {k} {x}?",
    ]
    ks = ["three", "four", "five", "six", "seven", "eight", "ten", "3", "5", "10"]
    return [t.format(k=k, x=x) for x in LIST_THINGS for k in ks for t in templates]


def _arithmetic(rng: random.Random) -> list[str]:
    """Single-step arithmetic questions and word problems."""

    def make(r: random.Random) -> str:
        kind = r.randrange(17)
        a, b = r.randint(13, 99), r.randint(13, 99)
        name, items = r.choice(NAMES), r.choice(COUNT_ITEMS)
        if kind == 0:
            return f"What is {a} + {b}?"
        if kind == 1:
            return f"What is {max(a, b)} - {min(a, b)}?"
        if kind == 2:
            return f"Calculate {r.randint(11, 40)} × {r.randint(3, 12)}."
        if kind == 3:
            d = r.randint(3, 12)
            return f"What is {d * r.randint(11, 40)} divided by {d}?"
        if kind == 4:
            return f"What is {r.choice([5, 10, 15, 20, 25, 50, 75])}% of {20 * r.randint(2, 30)}?"
        if kind == 5:
            return f"Round {r.randint(101, 9999)} to the nearest {r.choice(['ten', 'hundred'])}."
        if kind == 6:
            return f"What is {r.randint(11, 25)} squared?"
        if kind == 7:
            return f"Is {r.randint(20, 200)} a prime number? Explain why or why not."
        if kind == 8:
            return f"{name} has {a} {items}. Then {name} buys {b} more. How many {items} does {name} have now?"
        if kind == 9:
            return (f"{name} had {max(a, b)} {items} and gave {min(a, b)} of them away. "
                    f"How many {items} does {name} have left?")
        if kind == 10:
            return f"A box holds {r.randint(12, 48)} {items}. How many {items} are in {r.randint(3, 15)} boxes?"
        if kind == 11:
            f = r.randint(3, 9)
            return f"{name} shares {f * r.randint(4, 20)} {items} equally among {f} friends. How many does each friend get?"
        if kind == 12:
            return f"There are {r.randint(25, 40)} students in a class and {r.randint(2, 9)} are absent today. How many students are present?"
        if kind == 13:
            return (f"A bus has {a} passengers. At the next stop {r.randint(2, 12)} people get off and "
                    f"{r.randint(2, 12)} get on. How many passengers are on the bus now?")
        if kind == 14:
            return f"What is the sum of {a}, {b} and {r.randint(13, 99)}?"
        if kind == 15:
            return r.choice([f"How many minutes are in {r.randint(2, 12)} hours?",
                             f"How many seconds are in {r.randint(2, 15)} minutes?",
                             f"How many days are in {r.randint(2, 9)} weeks?"])
        return f"Write {r.randint(1, 19)}/{r.choice([2, 4, 5, 8, 10, 20, 25])} as a decimal."

    return _sample_unique(make, rng, 900)


def _multistep_math(rng: random.Random) -> list[str]:
    """Multi-step word problems that ask for working."""
    steps = ["Show your steps.", "Explain your reasoning.", "Solve it step by step.", "Show your work."]

    def make(r: random.Random) -> str:
        kind = r.randrange(14)
        name = r.choice(NAMES)
        tail = r.choice(steps)
        if kind == 0:
            (i1, p1), (i2, p2) = r.sample(SHOP_ITEMS, 2)
            return (f"A shop sells {i1} for {p1} dollars each and {i2} for {p2} dollars each. {name} buys "
                    f"{r.randint(2, 9)} {i1} and {r.randint(2, 9)} {i2}. How much does {name} spend in total? {tail}")
        if kind == 1:
            per = r.randint(12, 40)
            return f"{name} reads {per} pages a day. A book has {per * r.randint(5, 20) + r.randint(0, per - 1)} pages. How many days does it take to finish it? {tail}"
        if kind == 2:
            return (f"A car drives at {r.choice([40, 50, 70, 90, 110])} km per hour for {r.randint(2, 6)} hours, then drives "
                    f"{r.randint(15, 95)} km more. What is the total distance? {tail}")
        if kind == 3:
            c = r.randint(2, 4)
            base = r.choice([12, 16, 20, 24])
            return f"A recipe needs {c} cups of flour for {base} cookies. How much flour is needed for {base * r.randint(2, 5)} cookies? {tail}"
        if kind == 4:
            return (f"{name} earns {r.randint(11, 30)} dollars per hour and works {r.randint(3, 8)} hours a day for "
                    f"{r.randint(3, 6)} days. How much does {name} earn in total? {tail}")
        if kind == 5:
            return (f"The temperature was {r.randint(-5, 15)} degrees in the morning, rose by {r.randint(3, 12)} degrees "
                    f"by noon and then fell by {r.randint(2, 14)} degrees by night. What was the temperature at night? {tail}")
        if kind == 6:
            return (f"A garden is {r.randint(6, 30)} meters long and {r.randint(4, 20)} meters wide. What is its area? "
                    f"If fencing costs {r.randint(3, 15)} dollars per meter, how much does it cost to fence the whole garden? {tail}")
        if kind == 7:
            return f"A class of {r.randint(21, 39)} students is split into groups of {r.randint(3, 6)}. How many full groups are there, and how many students are left over? {tail}"
        if kind == 8:
            return f"{name} has {6 * r.randint(5, 40)} dollars and spends a third on books and half of what remains on food. How much money is left? {tail}"
        if kind == 9:
            return f"A water tank holds {100 * r.randint(3, 20)} liters and is {r.choice([10, 20, 25, 40, 60, 75])}% full. How many more liters are needed to fill it? {tail}"
        if kind == 10:
            nums = [r.randint(10, 99) for _ in range(r.randint(4, 6))]
            return f"What is the average of {', '.join(map(str, nums[:-1]))} and {nums[-1]}? {tail}"
        if kind == 11:
            a, x, b = r.randint(2, 9), r.randint(2, 15), r.randint(1, 30)
            return f"Solve for x: {a}x + {b} = {a * x + b}. {tail}"
        if kind == 12:
            return f"A jacket costs {r.randint(4, 30) * 5} dollars and is on sale for {r.choice([10, 20, 25, 30, 40, 50])}% off. What is the sale price? {tail}"
        return (f"A train leaves at {r.randint(6, 11)}:{r.choice(['00', '15', '30', '45'])} in the morning and the trip takes "
                f"{r.randint(70, 250)} minutes. What time does it arrive? {tail}")

    return _sample_unique(make, rng, 700)


def _rewriting(rng: random.Random) -> list[str]:
    """Rewriting, paraphrasing, translation and grammar fixes."""
    out = [t.format(s=s) for s in SENTENCES for t in REWRITE_TEMPLATES]
    for s in BAD_GRAMMAR:
        out += [f"Fix the grammar in this sentence: {s}", f"Correct the mistakes in this sentence and explain them: {s}"]
    return out


def _summarising(rng: random.Random) -> list[str]:
    """Summaries and comprehension of short given texts."""
    return [t.format(p=p) for p in PASSAGES for t in SUMMARY_TEMPLATES]


def _code(rng: random.Random) -> list[str]:
    """Short programming tasks, code explanation and bug fixing."""
    out: list[str] = []
    for task in CODE_TASKS:
        out += [
            f"Write a Python function that {_third_person(task)}.",
            f"Write a Python function to {task}.",
            f"How can I {task} in Python?",
            f"Write a JavaScript function that {_third_person(task)}.",
            f"Show me how to {task} in Python, with a short example.",
            f"Write a short Python program to {task} and explain how it works.",
        ]
    for concept in CODE_CONCEPTS:
        out += [f"What is {concept} in programming?", f"Explain {concept} with a simple code example."]
    for snippet in CODE_SNIPPETS:
        out += [f"Explain what this Python code does:\n\n{snippet}", f"What does this Python code print?\n\n{snippet}",
                f"Add helpful comments to this Python code:\n\n{snippet}"]
    out += [f"Find and fix the bug in this Python code:\n\n{snippet}" for snippet in BUGGY_SNIPPETS]
    return out


def _definitions(rng: random.Random) -> list[str]:
    """Vocabulary: meanings, synonyms and example sentences."""
    templates = [
        "What does the word \"{w}\" mean?", "Define the word {w}.", "Use the word \"{w}\" in a sentence.",
        "Give two synonyms for the word {w}.", "Explain the meaning of \"{w}\" with an example.",
        "Write a sentence using the word {w} and explain what it means.",
    ]
    return [t.format(w=w) for w in WORDS_TO_DEFINE for t in templates]


def _comparisons(rng: random.Random) -> list[str]:
    """Compare-and-contrast questions."""
    templates = [
        "What is the difference between {a} and {b}?", "Compare {a} and {b}.",
        "How are {a} and {b} similar, and how are they different?",
        "Explain the main differences between {a} and {b} in a short table.",
    ]
    return [t.format(a=a, b=b) for a, b in COMPARE_PAIRS for t in templates]


def _howto(rng: random.Random) -> list[str]:
    """Practical how-to questions."""
    templates = [
        "How do I {t}?", "Give step-by-step instructions to {t}.", "What is the easiest way to {t}?",
        "Give me three tips to {t}.", "Explain to a beginner how to {t}.",
    ]
    return [t.format(t=task) for task in HOWTO_TASKS for t in templates]


def _advice(rng: random.Random) -> list[str]:
    """Advice and pros/cons questions."""
    out: list[str] = []
    for g in ADVICE_GERUNDS:
        out += [f"What should I know before {g}?", f"What are common mistakes people make when {g}?",
                f"What are the benefits of {g}?", f"What are the pros and cons of {g}?"]
    for t in ADVICE_TOPICS:
        out += [f"Give me some advice on {t}.", f"What are three practical tips for {t}?"]
    return out


def _creative(rng: random.Random) -> list[str]:
    """Poems, stories, scenes and dialogues."""
    out = [form.format(t=t) for t in CREATIVE_TOPICS for form in CREATIVE_FORMS]
    out += [f"Write a short story about {c} who {g}." for c in CHARACTERS for g in STORY_GOALS]
    for p in PLACES:
        out += [f"Write the opening paragraph of a mystery story set in {p}.", f"Describe {p} in a vivid paragraph.",
                f"Write a short scene that takes place in {p}."]
    pairs = [(a, b) for a in CHARACTERS for b in CHARACTERS if a != b]
    out += [f"Write a short dialogue between {a} and {b}." for a, b in rng.sample(pairs, 80)]
    return out


def _writing(rng: random.Random) -> list[str]:
    """Practical writing: emails, descriptions, invitations."""
    out = [f"Write a short email to {r} {p}." for r in RECIPIENTS for p in GENERIC_PURPOSES]
    out += [f"Write a short email to {r} {p}." for r, p in SPECIFIC_EMAILS]
    out += [f"Write a thank-you note to {r} for {g}." for r in THANK_RECIPIENTS for g in GIFTS]
    out += [f"Write the opening paragraph of a cover letter for a job as {j}." for j in JOBS]
    out += [f"Write a short speech for {o}." for o in OCCASIONS]
    for p in PRODUCTS:
        out += [f"Write a product description for {p}.", f"Write a short advertisement for {p}.",
                f"Write a customer review of {p}."]
    for o in OCCASIONS:
        out += [f"Write an invitation to {o}.", f"Write a short announcement for {o}.",
                f"Write a social media post about {o}."]
    return out


def _classification(rng: random.Random) -> list[str]:
    """Classification tasks: categories, sentiment, odd-one-out, parts of speech."""
    mass = {"spinach", "lettuce", "cabbage", "celery", "cauliflower", "beetroot", "asparagus", "kale", "garlic"}
    out: list[str] = []
    for x in FRUITS_TRAIN + VEGETABLES_TRAIN:
        np_ = x if x in mass else _article(x)
        out += [f"Is {np_} a fruit or a vegetable?", f"Would you classify {np_} as a fruit or a vegetable? Explain briefly."]
    for x, _cls in ANIMAL_CLASSES:
        out += [f"Is {_article(x)} a mammal, a bird, a fish, a reptile, or an amphibian?",
                f"Which group of animals does the {x} belong to? Explain how you know."]
    reviews = [(p, r) for p in REVIEW_PRODUCTS for r in POS_REVIEWS + NEG_REVIEWS + NEU_REVIEWS]
    review_t = [
        "Classify the sentiment of this review as positive, negative, or neutral: \"The {p} {r}.\"",
        "Is this customer review positive or negative? \"This {p} {r}.\"",
        "What is the tone of this review? \"My new {p} {r}.\"",
    ]
    out += [rng.choice(review_t).format(p=p, r=r) for p, r in rng.sample(reviews, 160)]
    groups = list(ODD_ONE_GROUPS)
    for _ in range(140):
        g_in, g_out = rng.sample(groups, 2)
        words = rng.sample(ODD_ONE_GROUPS[g_in], 3) + [rng.choice(ODD_ONE_GROUPS[g_out])]
        rng.shuffle(words)
        out.append(f"Which word does not belong in this group: {', '.join(words)}? Explain why.")
    out += [f"Is this sentence a question, a command, or a statement? \"{s}\"" for s in SENTENCE_TYPES]
    out += [f"Is this statement a fact or an opinion? \"{s}\"" for s in FACT_OR_OPINION]
    pos_pool = [w for ws in POS_WORDS.values() for w in ws]
    for _ in range(60):
        out.append(f"Label each word as a noun, a verb, or an adjective: {', '.join(rng.sample(pos_pool, 4))}.")
    for h, _topic in HEADLINES:
        out += [f"Which category does this headline belong to: sports, politics, science, business, or entertainment? \"{h}\"",
                f"Classify this news headline by topic: \"{h}\""]
    mammals = [a for a, c in ANIMAL_CLASSES if c == "mammal"]
    birds = [a for a, c in ANIMAL_CLASSES if c == "bird"]
    for _ in range(50):
        mix = rng.sample(mammals, 3) + rng.sample(birds, 3)
        rng.shuffle(mix)
        out.append(f"Sort these animals into mammals and birds: {', '.join(mix)}.")
    return _unique(out)


def _formatting(rng: random.Random) -> list[str]:
    """Formatting and text-manipulation tasks."""
    out: list[str] = []
    for _ in range(150):
        out.append(f"Sort these words alphabetically: {', '.join(rng.sample(SORT_WORDS, rng.randint(4, 7)))}.")
    goods = FRUITS_TRAIN + VEGETABLES_TRAIN + [x for x, _ in SHOP_ITEMS]
    for _ in range(80):
        out.append(f"Turn this into a numbered list: {', '.join(rng.sample(goods, rng.randint(3, 6)))}.")
    for _ in range(120):
        out.append(f"Format this information as JSON with the keys name, age and city: {rng.choice(NAMES)} is "
                   f"{rng.randint(18, 80)} years old and lives in {rng.choice(CITIES)}.")
    for s in SENTENCES:
        out += [f"Write this sentence in title case: {s}", f"Convert this sentence to uppercase: {s}",
                f"How many words are in this sentence? \"{s}\""]
    for _ in range(100):
        nums = [str(rng.randint(13, 999)) for _ in range(rng.randint(5, 7))]
        order = rng.choice(["ascending", "descending"])
        out.append(f"Put these numbers in {order} order: {', '.join(nums)}.")
    for _ in range(60):
        people = ", ".join(f"{n} ({rng.randint(18, 70)})" for n in rng.sample(NAMES, rng.randint(3, 5)))
        out.append(f"Create a markdown table with the columns Name and Age for these people: {people}.")
    for m, d, y in DATES:
        out += [f"Write the date {m} {d}, {y} in the format YYYY-MM-DD.", f"Write the date {m} {d}, {y} in the format DD/MM/YYYY."]
    for _ in range(40):
        rows = "; ".join(f"{n} scored {rng.randint(40, 100)} points" for n in rng.sample(NAMES, 3))
        out.append(f"Write this data as CSV with a header row: {rows}.")
    out += [f"Write a short checklist for organizing {o}." for o in OCCASIONS]
    return _unique(out)


def _short_answer(rng: random.Random) -> list[str]:
    """Short-answer questions with an explicit brevity instruction."""
    one, num, brief = "Answer with one word.", "Answer with just the number.", "Answer briefly."
    out = [f"What is the capital of {c}? {rng.choice([brief, 'Give a short answer.'])}" for c in COUNTRIES]
    out += [f"What is the opposite of {w}? {one}" for w in ANTONYM_WORDS]
    out += [f"What is the past tense of {v}? {one}" for v in PAST_TENSE_VERBS]
    out += [f"What is the plural of {n}? {one}" for n in PLURAL_NOUNS]
    out += [f"How many sides does {_article(x)} have? {num}" for x in SHAPES_SIDES]
    out += [f"What color do you get when you mix {a} and {b}? {one}" for a, b in COLOR_MIXES]
    out += [f"What is a baby {x} called? {one}" for x in BABY_ANIMALS]
    out += [f"{q} {brief}" for q in SHORT_FACT_QUESTIONS]
    out += [f"{q} Reply with only the answer." for q in SHORT_FACT_QUESTIONS]
    for x in FRUITS_TRAIN:
        out.append(f"Is {_article(x)} a fruit or a vegetable? {one}")
    for x, _cls in ANIMAL_CLASSES:
        out.append(f"Is {_article(x)} a mammal, a bird, a fish, a reptile, or an amphibian? {one}")

    def arithmetic(r: random.Random) -> str:
        a, b = r.randint(13, 99), r.randint(13, 99)
        kind = r.randrange(4)
        if kind == 0:
            return f"What is {a} + {b}? {num}"
        if kind == 1:
            return f"What is {max(a, b)} - {min(a, b)}? {num}"
        if kind == 2:
            return f"What is {r.randint(13, 25)} times {r.randint(2, 9)}? Reply with only the number."
        d = r.randint(2, 9)
        return f"What is {d * r.randint(13, 30)} divided by {d}? {num}"

    out += _sample_unique(arithmetic, rng, 250)
    return _unique(out)


CATEGORIES: dict[str, Callable[[random.Random], list[str]]] = {
    "facts_geography": _facts_geography,
    "facts_nature": _facts_nature,
    "facts_history": _facts_history,
    "explanation": _explanations,
    "list": _lists,
    "arithmetic": _arithmetic,
    "multistep_math": _multistep_math,
    "rewriting": _rewriting,
    "summarising": _summarising,
    "code": _code,
    "definition": _definitions,
    "comparison": _comparisons,
    "howto": _howto,
    "advice": _advice,
    "creative": _creative,
    "writing": _writing,
    "classification": _classification,
    "formatting": _formatting,
    "short_answer": _short_answer,
}


# --------------------------------------------------------------------------------------
# Exclusion of eval prompts (exact and near-duplicate)
# --------------------------------------------------------------------------------------

_STOPWORDS = frozenset(
    """a an the is are was were be been being am do does did of to in on at for from by with and or but
    not no yes what which who whom whose when where why how this that these those it its i you your me my
    we our they their he she his her them just only please can could would should will shall may might must
    about into than then there here some any each every as so if also very more most much many give tell
    write name list describe explain answer reply word words number sentence short simple following text
    using use make one letter calculate compute solve show step instruction briefly example
    plus minus times multiplied divided""".split()
)
_NUMBER_CANON = {w: str(i) for i, w in enumerate(_NUMBER_WORDS)}
_SYNONYM_CANON = {"antonym": "opposite", "capitol": "capital"}
_NEAR_DUP_FRACTION = 0.75  # share of the eval prompt's content words that must reappear
_NEAR_DUP_OWN_FRACTION = 0.5  # ...and must be more than this share of the training prompt's own


def normalise_prompt(text: str) -> str:
    """Case-fold a prompt and collapse whitespace (the exact-match key)."""
    return " ".join(text.split()).casefold()


def _stem(token: str) -> str:
    """Very light plural stripping so that 'fruits' and 'fruit' compare equal."""
    if token.isdigit() or len(token) <= 3:
        return token
    if token.endswith("ies") and len(token) > 4:
        return token[:-3] + "y"
    if token.endswith(("ches", "shes", "xes", "sses")):
        return token[:-2]
    if token.endswith("s") and not token.endswith(("ss", "us", "is")):
        return token[:-1]
    return token


def content_words(text: str) -> frozenset[str]:
    """Return the normalised content-word set used for near-duplicate detection."""
    words: set[str] = set()
    for tok in re.findall(r"[a-z0-9]+", text.casefold()):
        if tok in _STOPWORDS or (len(tok) == 1 and not tok.isdigit()):
            continue
        tok = _NUMBER_CANON.get(tok, tok)
        tok = _stem(tok)
        words.add(_SYNONYM_CANON.get(tok, tok))
    return frozenset(words)


def load_excluded_prompts(paths: Sequence[Path] = EVAL_FILES) -> list[str]:
    """Read the 'prompt' field of every line of the given JSONL eval files."""
    prompts: list[str] = []
    for path in paths:
        if not Path(path).exists():
            raise FileNotFoundError(f"eval file needed for de-duplication is missing: {path}")
        with Path(path).open(encoding="utf-8") as handle:
            prompts += [json.loads(line)["prompt"] for line in handle if line.strip()]
    return prompts


class EvalFilter:
    """Rejects prompts equal to, or near-duplicates of, held-out eval prompts."""

    def __init__(self, eval_prompts: Sequence[str]) -> None:
        """Index the eval prompts by normalised text and by content word."""
        self.exact = {normalise_prompt(p) for p in eval_prompts}
        self.needed: list[int] = []
        self.ids: list[int] = []
        self.index: dict[str, list[int]] = {}
        for position, prompt in enumerate(eval_prompts):
            words = content_words(prompt)
            if len(words) < 2:
                continue
            idx = len(self.needed)
            self.ids.append(position)
            self.needed.append(max(2, math.ceil(_NEAR_DUP_FRACTION * len(words))))
            for word in sorted(words):
                self.index.setdefault(word, []).append(idx)

    def match(self, prompt: str) -> int | None:
        """Return the index (in eval order, -1 for exact) of the eval prompt this duplicates, else None."""
        if normalise_prompt(prompt) in self.exact:
            return -1
        words = content_words(prompt)
        hits = Counter(i for w in words for i in self.index.get(w, ()))
        for i, shared in sorted(hits.items()):
            if shared >= self.needed[i] and shared > _NEAR_DUP_OWN_FRACTION * len(words):
                return self.ids[i]
        return None

    def rejects(self, prompt: str) -> bool:
        """True if prompt equals an eval prompt or is a near-duplicate of one (rule documented in training/data/README.md)."""
        return self.match(prompt) is not None


# --------------------------------------------------------------------------------------
# Pool construction and sampling
# --------------------------------------------------------------------------------------

@lru_cache(maxsize=4)
def _pool(exclude_files: tuple[str, ...]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Build the filtered, globally de-duplicated candidate pool per category (seed-independent)."""
    filt = EvalFilter(load_excluded_prompts([Path(p) for p in exclude_files]))
    seen: set[str] = set()
    pool: list[tuple[str, tuple[str, ...]]] = []
    for offset, (category, generate) in enumerate(CATEGORIES.items()):
        kept: list[str] = []
        for prompt in generate(random.Random(_POOL_SEED + offset)):
            key = normalise_prompt(prompt)
            if key in seen or filt.rejects(prompt):
                continue
            seen.add(key)
            kept.append(prompt)
        pool.append((category, tuple(kept)))
    return tuple(pool)


def pool_sizes(exclude_files: Sequence[Path] = EVAL_FILES) -> dict[str, int]:
    """Return the number of available (filtered) candidate prompts per category."""
    return {cat: len(items) for cat, items in _pool(tuple(str(p) for p in exclude_files))}


def build_prompts_with_categories(
    n: int = 8000, seed: int = 0, *, exclude_files: Sequence[Path] = EVAL_FILES
) -> list[tuple[str, str]]:
    """Return n unique (category, prompt) pairs, balanced across categories by round-robin."""
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    pool = _pool(tuple(str(p) for p in exclude_files))
    total = sum(len(items) for _, items in pool)
    if n > total:
        raise ValueError(f"requested {n} prompts but only {total} unique candidates exist")
    rng = random.Random(seed)
    queues: list[tuple[str, list[str]]] = []
    for category, items in pool:
        shuffled = list(items)
        rng.shuffle(shuffled)
        queues.append((category, shuffled))
    chosen: list[tuple[str, str]] = []
    depth = 0
    while len(chosen) < n:
        for category, items in queues:
            if depth < len(items) and len(chosen) < n:
                chosen.append((category, items[depth]))
        depth += 1
    rng.shuffle(chosen)
    return chosen


def build_prompts(n: int = 8000, seed: int = 0) -> list[str]:
    """Return n unique training prompts, deterministic for a given seed and free of eval prompts."""
    return [prompt for _, prompt in build_prompts_with_categories(n, seed)]


def main(argv: Sequence[str] | None = None) -> None:
    """Write the training prompt set to JSONL and print per-category counts."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=8000, help="number of prompts")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output JSONL path")
    args = parser.parse_args(argv)
    rows = build_prompts_with_categories(args.n, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as handle:
        for category, prompt in rows:
            handle.write(json.dumps({"prompt": prompt, "category": category}, ensure_ascii=False) + "\n")
    counts = Counter(category for category, _ in rows)
    print(f"wrote {len(rows)} prompts to {args.out}")
    for category in CATEGORIES:
        print(f"  {category:16s} {counts[category]:5d}")


if __name__ == "__main__":
    main()
