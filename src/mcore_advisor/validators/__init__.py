"""validators"""
