"""replaying"""
