"""Model families other than causal LMs (BERT, GPT-2, ViT, Marian) through the same methods."""
