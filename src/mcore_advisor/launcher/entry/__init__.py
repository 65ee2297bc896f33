"""launcher/entry"""
