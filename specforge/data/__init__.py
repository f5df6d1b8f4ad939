"""Data: conversation readers, chat-template tokenization with loss masks, self-distillation,
the draft vocabulary map, and the built-in prompt set."""
