"""The Python face: `PromptCache`, in-process or against a server, and the functions its decorator makes.

`prefixgate.proxy` exports what users import; the modules here are its parts.
"""
