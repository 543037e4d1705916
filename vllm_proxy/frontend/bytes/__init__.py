"""Bytes from the client: its connection, its request body, forms and uploads.

* `connection`: the listening sockets and each client connection (header and idle timeouts);
* `intake`: reading a body within the size, time and memory budgets (`Bodies`, `Hold`);
* `body`: finding ``model`` in a JSON body without parsing it whole, and renaming it;
* `form` and `upload`: a multipart form's ``model`` field, and the upload passed on as it comes;
* `heap`: giving freed memory back to the system after large bodies.
"""
