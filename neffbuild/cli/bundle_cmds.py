def register(group):
    pass
