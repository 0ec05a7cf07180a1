"""The Responses API (/v1/responses): a translation onto the chat plan, its typed event stream and the bounded
store behind previous_response_id. Torch-free; must not reach into the chat routes' private parts."""
