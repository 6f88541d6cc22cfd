"""Stage 8: the adapter verified and shipped (`stage`), merged 16-bit weights (`merge`), GGUF through llama.cpp's
converter (`gguf`), model cards, processors and the hub (`share`)."""
