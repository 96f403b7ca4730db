"""The loops and the controller: compiled train and eval calls (sync and async), and the outer loop between them."""
