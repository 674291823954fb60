"""Chat prompts for measuring speculative acceptance (``benchmark/bench_acceptance.py`` and the
shipped-head test in ``test/integration/test_lookahead.py``)."""

# Everyday chat requests. None is one of scripts/train_eagle3.py's training templates or topics (its
# held-out questions are held out of training too).
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Explain what a hash table is in two sentences.",
    "Write a short poem about the sea.",
    "How do I boil an egg?",
    "What are the benefits of regular exercise?",
    "Summarise the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "How do I make a cup of tea?",
    "Write a haiku about autumn.",
    "Give me some tips to sleep better.",
    "What is the difference between weather and climate?",
    "How can I be more productive when working from home?",
    "Tell me a fun fact about space.",
    "What should I pack for a weekend camping trip?",
    "Explain what an API is.",
    "Can you recommend a good book for a long flight?",
    "How do I write a polite email asking for a deadline extension?",
    "What is a healthy breakfast I can make in five minutes?",
    "Explain the difference between a virus and a bacterium.",
    "How should I prepare for my first marathon?",
    "Write a thank-you note to a teacher.",
    "What are some fun things to do on a rainy day?",
    "How does a refrigerator keep food cold?",
)
