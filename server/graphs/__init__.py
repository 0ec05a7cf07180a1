"""Device-side graphs behind one protocol: forward(embeds [1,T,H], positions [1,T]) -> logits [1,T,V]."""
