"""How the budget is spent: the user's model (`shape`), what is asked (`inputs`), candidates as changes to the user's
placement (`derived`), the plan (`plan`, its record `plan_record`) and what each stage costs on this machine
(`cost`)."""
