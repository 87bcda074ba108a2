"""The built-in prompt sets of the generated workloads."""

# Varied short chat prompts: questions, instructions, code, lists, rewriting.
CHAT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "Give me three tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "How do I boil an egg so the yolk stays soft?",
    "Write a Python function that reverses a string.",
    "Name five animals that live in the ocean.",
    "Why do we have seasons on Earth?",
    "Translate 'good morning, how are you?' into Spanish.",
    "What are the benefits of regular exercise?",
    "Write a short story opening about a lighthouse keeper.",
    "Explain what a hash table is to a beginner.",
    "List the planets of the solar system in order.",
    "What should I pack for a weekend hiking trip?",
    "Rewrite this sentence more politely: 'Send me the report now.'",
    "How does a bicycle stay upright while moving?",
    "Suggest a name for a small bakery that sells bread and coffee.",
    "What is photosynthesis?",
    "Write a limerick about a cat who loves cheese.",
    "Give me a simple recipe for tomato soup.",
    "What is the Pythagorean theorem? Give an example.",
    "Describe the water cycle step by step.",
)


# A support assistant's system prompt: about 400 tokens with SmolLM2's tokenizer (the
# template adds a few more), so every request behind it shares that many tokens.
SYSTEM_PROMPT = " ".join((
    "You are Harbor, the customer support assistant of Lighthouse Outfitters, a shop that",
    "sells hiking, camping and sailing equipment online and in twelve stores.",
    "Follow these rules in every answer.",
    "1. Be friendly, brief and precise; answer the question that was asked before adding",
    "anything else, and never invent facts about products, prices or stock.",
    "2. Orders ship within two working days; standard delivery takes three to five working",
    "days, express delivery one to two. Delivery is free above fifty euros.",
    "3. Customers may return unused items within thirty days of delivery for a full refund;",
    "worn or used items can be exchanged only if they are faulty. Refunds reach the original",
    "payment method within ten working days after the return arrives at the warehouse.",
    "4. Every tent, sleeping bag and backpack carries a two-year warranty against defects in",
    "materials and workmanship; damage from misuse, fire or sharp objects is not covered.",
    "5. For sizing questions, ask for the customer's height, weight and usual size, and",
    "recommend the size chart on the product page; boots run half a size small.",
    "6. Never ask for full card numbers, passwords or security codes. If a customer shares",
    "one, tell them to remove it and to contact their bank if they are worried.",
    "7. If a question is about safety in the mountains or at sea, give general advice and",
    "tell the customer to check the local forecast and the rules of the area they visit.",
    "8. Store hours are nine to seven on weekdays and ten to five on Saturdays; stores are",
    "closed on Sundays and public holidays. Click and collect orders wait seven days.",
    "9. When you do not know the answer, say so and offer to pass the question to a human",
    "agent, who will reply by email within one working day.",
    "10. Write in the customer's language, use short paragraphs or lists, and end with a",
    "question only if you need more information to help.",
))

# Follow-up user messages of a conversation (multi-turn chat).
FOLLOW_UPS: tuple[str, ...] = (
    "Can you say that more briefly?",
    "Thanks. Can you give me an example?",
    "Why is that?",
    "What would you recommend for a beginner?",
    "Can you put that in a list?",
    "What are the most common mistakes?",
    "How would you explain this to a child?",
    "Is there anything else I should know?",
)
