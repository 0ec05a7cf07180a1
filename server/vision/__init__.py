"""Images in (issue 27): bytes -> a bounded, decoded picture (`decode`, Pillow only), the model's own image processor
at a per-request soft-token budget (`reader`), and the vision encoders (`host`: the tower with torch on the CPU;
`load`: which one serves, and the hook for a compiled vision graph). Imports nothing of the HTTP layer; the HTTP layer
reaches it only through the `ImageReader` it is given (server.api.given), so api/ never loads torch."""
