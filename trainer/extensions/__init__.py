"""Extensions: every optional feature, built in or a researcher's own, through one protocol."""
